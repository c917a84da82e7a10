"""Helpers of ablate.py: the kernel sweep (sweep.py), the matched training runs and the context probe
(matched.py), and the report with its plots (report.py). The I/O byte model is io_model.py."""
