#: Why the tests that run SGLang's memory saver skip where it is not installed.
TMS_REASON = (
    "needs torch_memory_saver 0.0.10 and its preload library "
    "(pip install torch_memory_saver==0.0.10)"
)
