"""Several GPUs of one host: the link per GPU and FSDP2 with offloading."""
