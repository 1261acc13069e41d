"""The doctor: the node's and the job's NCCL setup (facts from sysfs, procfs and NVML's inventory), the
checks that turn them into findings with a fix, and their text. Imports only the core and sample/."""
