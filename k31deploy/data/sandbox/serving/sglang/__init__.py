"""The k31 sandbox's stand-in for SGLang: only `python3 -m sglang.launch_server` exists (k31deploy.standin)."""
