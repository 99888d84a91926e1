"""pdserve's cluster layer: the `pdserve` command line and launching router, prefill and decode workers."""
