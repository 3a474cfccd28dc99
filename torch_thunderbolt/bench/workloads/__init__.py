"""`bench --workload`: a model's training step or decoded token timed on every measured backend, interleaved.

Modules: spec (the workloads, devices, hooks; the columns' arithmetic and the RDMA projection; pure),
device (the device a rank's model runs on), ddp (ViT under DDP), decode (a Llama-shaped decoder, pipeline
or tensor parallel), table (text output; pure), session (one rank's run).
"""
