"""Packaging for torch_gdr: the chunked gated delta rule as a PyTorch op."""

from setuptools import find_packages, setup

setup(
    name="torch_gdr",
    version="0.1.0",
    description="Chunked gated delta rule (Gated DeltaNet) as a PyTorch op: pure-torch and PyPTO backends",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_gdr", "torch_gdr.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4,<3", "einops>=0.7", "tqdm>=4.60"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "numpy"],
        "npu": ["pypto==0.2.0"],
        # the "fla" backend calls fla-core's internal chunk forward/backward, whose
        # signatures are those of 0.6.x (torch_gdr/ops/fla); tested range only
        "gpu": ["fla-core>=0.6.0,<0.7"],
        "bench": ["pytest-benchmark>=4", "transformers>=4.57"],
    },
)
