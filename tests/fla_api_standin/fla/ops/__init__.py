"""fla.ops of the stand-in: only the gated delta rule."""
