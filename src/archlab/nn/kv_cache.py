"""The simplest KV cache: keys and values grow by concatenation, one entry per layer.

Protocol every cache follows (the model and attention know nothing else about caches):
    k_all, v_all, k_pos = cache.update(layer, k, v, positions)
      k, v:       (b, k, t, e) the new keys (already rotated for RoPE) and values
      positions:  (b, t) their positions (-1 = padding)
      returns     (b, k, s, e), (b, k, s, e), (b, s) everything the queries may look at
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
            positions = torch.cat((self.positions[layer], positions), dim=1)
        self.keys[layer], self.values[layer], self.positions[layer] = k, v, positions
        return k, v, positions

    def __len__(self) -> int:
        return next(iter(self.positions.values())).shape[1] if self.positions else 0
