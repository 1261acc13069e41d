"""Readers of what people paste about a job that is not a stack, a timeout or a NCCL report: nvidia-smi's table,
the kernel's Xid lines, a crash. Each turns one text into a Finding that `analyze` weighs beside the rest."""
