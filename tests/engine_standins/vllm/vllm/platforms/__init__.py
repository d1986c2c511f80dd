"""Stand-in for ``vllm.platforms`` (tests only): the platform answers both the CUDA-only
tests (run on the CPU by ``cuda_on_cpu``) and the CPU-only tests."""


class _Platform:
    def is_cuda_alike(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True


current_platform = _Platform()
