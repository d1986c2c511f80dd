"""Stand-in for vLLM's CPU GDN attention layer module (tests only): vLLM's own layer code
(``_spec_aware_nonspec``) is not torch_gdr's; the test of it is left out by the runner."""
