"""The seam over the operating system and the CUDA driver: standard library only, no torch.

``linux``: prctl, pidfd and seccomp facts (what CUDA IPC of expandable segments
needs); ``cuda_driver``: ``libcuda.so.1``, loaded once.
"""
