"""How a model's layers share KV pages: one group of layers per block table.

Most models keep every layer's KV for every token, so one block table serves all layers and a page (a
block's memory) holds every layer. A model that interleaves sliding-window layers with global ones (Gemma 3)
needs the window layers' KV only for the last ``window`` tokens: their pages can be freed once the
queries have moved past them, while the global layers keep all of theirs. The layers are then cut into
groups of equal size, each with a block table of its own over one shared pool of pages:

    Gemma 3 270M, 3 global and 15 window layers   ->   6 groups of 3 layers (pages of 3 layers' KV)
        group 0: the global layers 5 11 17     every block of tokens keeps its page
        groups 1-5: the window layers          a block's pages go back to the pool once out of the window

Group 0 is always made of global layers: its table is the request's ``block_ids``, the one the prefix cache
keys. Page 0 is then reserved as the *null page*: a window group's table points there for the blocks it has
freed (the window mask hides them; the page stays zero, so reading it is harmless).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.arch import ArchConfig

NULL_PAGE = 0


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    layers_per_page: int
    groups: tuple[tuple[int, ...], ...]  # the layers of each group; group 0 first
    windowed: tuple[bool, ...]  # per group: True for a sliding-window group
    window: int  # the window groups' window in tokens (0: no window group)

    @classmethod
    def for_arch(cls, arch: ArchConfig) -> KVLayout:
        """Groups of global and of window layers when the model has both; else one group of all layers."""
        layers = range(arch.num_layers)
        window_layers = [i for i in layers if arch.layer_window(i) is not None]
        global_layers = [i for i in layers if arch.layer_window(i) is None]
        if not window_layers or not global_layers:
            return cls.single(arch.num_layers)
        size = math.gcd(len(window_layers), len(global_layers))
        global_groups = [tuple(global_layers[i : i + size]) for i in range(0, len(global_layers), size)]
        window_groups = [tuple(window_layers[i : i + size]) for i in range(0, len(window_layers), size)]
        return cls(arch.num_layers, size, (*global_groups, *window_groups),
                   (False,) * len(global_groups) + (True,) * len(window_groups), arch.sliding_window)

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one group: one table, pages of all layers (no layer frees anything)."""
        return cls(num_layers, num_layers, (tuple(range(num_layers)),), (False,), 0)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_grouped(self) -> bool:
        return self.num_groups > 1

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Per layer: the group whose block table it reads."""
        out = [0] * self.num_layers
        for g, layers in enumerate(self.groups):
            for layer in layers:
                out[layer] = g
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Per layer: its place within its group's pages (which page tensor it reads and writes)."""
        out = [0] * self.num_layers
        for layers in self.groups:
            for slot, layer in enumerate(layers):
                out[layer] = slot
        return tuple(out)

    def first_block_in_window(self, position: int, block_size: int) -> int:
        """The first block a query at ``position`` or later still reads in a window group: a query at p
        sees keys p - window + 1 .. p, so every block wholly before p - window + 1 can go."""
        if not self.window:
            return 0
        return max(0, position - self.window + 1) // block_size

    def num_pages(self, num_blocks: int) -> int:
        """Pages holding the memory of ``num_blocks`` blocks of every layer, the null page included."""
        return num_blocks * self.num_groups + (1 if self.is_grouped else 0)

    def max_tokens(self, num_pages: int, block_size: int, chunk_tokens: int) -> int:
        """The longest sequence one request can hold alone in ``num_pages`` pages, computed in chunks of up to
        ``chunk_tokens``: every block keeps its global pages, and its window pages while a chunk still reads
        them."""
        if not self.is_grouped:
            return num_pages * block_size
        num_window = sum(self.windowed)
        num_global = self.num_groups - num_window
        every_page = (num_pages - 1) // self.num_groups  # blocks whose window pages are all still held
        window_blocks = -(-(self.window + chunk_tokens) // block_size) + 1
        past_window = (num_pages - 1 - num_window * window_blocks) // num_global
        return max(every_page, past_window) * block_size
