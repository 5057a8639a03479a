"""rlx built-in plugins."""


def process_rank() -> int:
    """This process's rank under torch.distributed (0 alone): each rank's engine samples with its own seed."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
