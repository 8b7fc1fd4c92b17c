"""Counting the aten ops a block of code dispatches (forward and backward): how tests hold a
kernel count to a bound or independent of a size, on CPU."""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """aten ops dispatched inside the block, by name; ``shapes[name]``: their first inputs' shapes."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
        self.shapes = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.count[name] += 1
        if args and isinstance(args[0], torch.Tensor):
            self.shapes[name].append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))
