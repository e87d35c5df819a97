"""ZeRO-3's plan at another world size without walking the step again (issue 7's speed).

What a ZeRO-3 rank does (strategies/zero3.py, `_Rank`) depends on the world size W only through:
- each parameter's partition ceil(n / W), and W itself: the sizes of the partitions, the flat buffers, the fp32
  masters, the sub-groups' gradients and optimizer state, the gathered buffers (W x partitions);
- the sub-groups (`_create_fp16_sub_groups` closes a group once its partitions reach `sub_group_size`), and the
  largest of them (the zero fp32 gradient `initialize_optimizer_states` drops);
- each reduce-scatter's padding (`__avg_scatter_grads`: one zero tensor per rank past a parameter's last real
  element, then the `torch.cat` that a single parameter divisible by W does without).
Which parameters are gathered, prefetched, released, kept persistent or bucketed, and when, is decided on element
counts (`numel`, `stage3_*` thresholds in parameters, `reduce_bucket_size`), never on partitions.

So a walk records a `Program` (`record`): the rank's events in order, each own event with the formula of its size
(`Sized`), each reduce-scatter's paddings and `torch.cat` as a block to generate. `Program.frame(W)` evaluates it for
any W with the recorded sub-groups: the sizes vectorised over the parameters, the blocks generated, the serials
renumbered (every allocation takes the next serial, so a block of another length shifts the serials after it).
Another W whose sub-groups differ gets a program of its own, recorded by a walk at that W.

During the recording the partitions and W are `Sized`/`World` values: multiplying them by a plain int or by W
keeps the formula, and every other use (a sum, a comparison, `%`, truth, `range`) raises, so no decision of the walk can
read W unnoticed; the walk reads the partitions' values (`int(...)`) only where this module evaluates the same
decision again for the new W (the sub-group bounds, the blocks, the largest sub-group).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.enums import Category, Phase
from llmsim.model.tracker import NO_BLOCK, TIMELINE_COLUMNS

MAX_TERMS = "max"  # a `Sized` whose terms are ("max", groups): the largest of the groups' sums
_STRING_COLUMNS = ["step", "phase", "block", "module", "category", "tensor"]  # what a row takes from its prototype
_LITERAL, _ALLOC, _FREE = 0, 1, 2  # a fixed row: a copied row (serial and bytes as recorded), an allocation, a free
_BLOCK, _CAT_FREE = 0, 1  # a variable item: paddings + `torch.cat` + the paddings freed; the `torch.cat` freed


def _refuse(self, *args):
    raise TypeError(f"{type(self).__name__}({int(self)}): the ZeRO-3 walk read the world size other than as a "
                    "size factor; decide it in strategies/zero3_resize.py for every world size")


class Sized:
    """An element or byte count that depends on W, with its formula: scale x W**k x sum(coef x ceil(numel_i / W))
    over `terms` ((i, coef), ...), or with terms ("max", (terms, ...)) the largest of those sums. Not an int: only
    `int(...)` reads its value (range, indexing, comparisons and sums raise)."""

    __slots__ = ("value", "formula")

    def __init__(self, value: int, terms: tuple, k: int = 0, scale: int = 1) -> None:
        self.value, self.formula = value, (terms, k, scale)

    def __int__(self) -> int:
        return self.value

    def __mul__(self, other):
        terms, k, scale = self.formula
        if type(other) is int:
            return Sized(self.value * other, terms, k, scale * other)
        if type(other) is World and k == 0:
            return Sized(self.value * other.value, terms, 1, scale)
        return _refuse(self)

    __rmul__ = __mul__
    __add__ = __radd__ = __sub__ = __rsub__ = __neg__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _refuse
    __truediv__ = __rtruediv__ = __divmod__ = __rdivmod__ = __pow__ = __index__ = __bool__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = None


class World:
    """W during a recording walk: a factor of a `Sized`, nothing else (`int(...)` reads it)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value

    def __mul__(self, other):
        return other * self if type(other) is Sized else _refuse(self)

    __rmul__ = __mul__
    __add__ = __radd__ = __sub__ = __rsub__ = __neg__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _refuse
    __truediv__ = __rtruediv__ = __divmod__ = __rdivmod__ = __pow__ = __index__ = __bool__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = None


def partitions(numels: np.ndarray, world: int) -> np.ndarray:
    """ceil(numel / W) per parameter (partition_parameters.py, `_partition_param`)."""
    return -(-numels // world)


def sub_group_ends(partition_numels, size) -> tuple[int, ...]:
    """stage3.py `_create_fp16_sub_groups` over the trainable parameters' partitions: the end of each sub-group."""
    n = len(partition_numels)
    if size is None or size >= sum(partition_numels):
        return (n,)
    ends, numel = [], 0
    for i, partition in enumerate(partition_numels):
        numel += partition
        if numel >= size or i == n - 1:
            ends.append(i + 1)
            numel = 0
    return tuple(ends)


def grouped_sub_group_ends(partition_numels, size, group_lengths) -> tuple[int, ...]:
    """`sub_group_ends` within each of the optimizer's param groups (stage3.py makes each param group's sub-groups
    apart: `_create_fp16_partitions_with_defragmentation`), the parameters laid out group after group; an empty
    group has none."""
    ends, start = [], 0
    for length in group_lengths:
        if length:
            ends += [start + end for end in sub_group_ends(partition_numels[start:start + length], size)]
        start += length
    return tuple(ends)


class Recorder:
    """The writer (zero_common.EventWriter's interface) of a recording walk: every row in order, a copied one by its
    source index or its values, an own event with its size's formula and, for a free, the allocation it frees;
    each reduce-scatter's paddings and `torch.cat` as a block (`padded_cat`)."""

    def __init__(self, first_serial: int, module: str, steps_on_host: bool) -> None:
        self.step, self.phase, self.module = 0, Phase.BUILD.value, module
        self.steps_on_host = steps_on_host
        self.first_serial = first_serial
        self.next_id = first_serial
        self.order: list[int] = []  # fixed rows: >= 0 a source row, < 0 own row -1 - i
        self.protos: list[tuple] = []  # per own row: (step, phase, block, module, category, tensor)
        self.item_protos: list[tuple] = []  # the same, per variable item
        self.kinds: list[int] = []  # per own row
        self.serials: list[int] = []  # per own row: a copied row's or a freed source storage's serial, else -1
        self.refs: list[int] = []  # per own row: the fixed row of the allocation a free frees, else -1
        self.literals: list[int] = []  # per own row: its bytes when they do not depend on W
        self.formulas: list[int] = []  # per own row: its `Sized` formula's index, else -1
        self.formula_ids: dict[tuple, int] = {}
        self.allocated: dict[int, int] = {}  # id -> fixed row of its allocation
        self.items: list[tuple[int, int, int]] = []  # variable: (kind, fixed rows before it, flush)
        self.item_category: dict[int, Category] = {}  # per flush: the paddings' and `torch.cat`'s category
        self.flushes: list[tuple[tuple[int, ...], int, int]] = []  # (parameter indices, elem bytes, cat formula)
        self.cats: dict[int, int] = {}  # the id of a flush's `torch.cat` -> the flush

    def keep(self, row: tuple) -> None:
        self.step, self.phase = row[0], row[1]
        self._own((row[0], row[1], row[2], row[3], row[6], row[7]), _LITERAL, int(row[4]), -1, int(row[5]), -1)

    def keep_run(self, rows: list[tuple], start: int, stop: int) -> None:
        self.step, self.phase = rows[stop - 1][0], rows[stop - 1][1]
        self.order.extend(range(start, stop))

    def alloc(self, nbytes: int, category: Category, module: str | None = None) -> int:
        serial = self.next_id
        self.next_id += 1
        self.allocated[serial] = len(self.order)
        self._event(_ALLOC, -1, -1, nbytes, category, module)
        return serial

    def free(self, serial: int, nbytes: int, category: Category, module: str | None = None) -> None:
        if serial in self.cats:
            self._item(_CAT_FREE, self.cats.pop(serial))
        elif serial >= self.first_serial:
            self._event(_FREE, -1, self.allocated.pop(serial), nbytes, category, module)
        else:  # a storage of the single-process trace (a gradient, an adapter's whole tensor)
            self._event(_FREE, serial, -1, nbytes, category, module)

    def padded_cat(self, params: list[int], elem: int, flat_bytes: Sized, category: Category) -> tuple[int, int]:
        """`__avg_scatter_grads`' paddings and `torch.cat` over the bucket's parameters (ds_id order) at any W."""
        self.flushes.append((tuple(params), elem, self._formula(flat_bytes)))
        self.item_category[len(self.flushes) - 1] = category
        self._item(_BLOCK, len(self.flushes) - 1)
        serial = self.next_id
        self.next_id += 1
        self.cats[serial] = len(self.flushes) - 1
        return serial, flat_bytes

    def _event(self, kind: int, serial: int, ref: int, nbytes: int, category: Category, module: str | None) -> None:
        proto = (self.step, self.phase, NO_BLOCK, module or self.module, category.value, "")
        if type(nbytes) is Sized:
            self._own(proto, kind, serial, ref, 0, self._formula(nbytes))
        else:
            self._own(proto, kind, serial, ref, -int(nbytes) if kind == _FREE else int(nbytes), -1)

    def _own(self, proto: tuple, kind: int, serial: int, ref: int, literal: int, formula: int) -> None:
        self.order.append(-1 - len(self.kinds))
        self.protos.append(proto)
        self.kinds.append(kind)
        self.serials.append(serial)
        self.refs.append(ref)
        self.literals.append(literal)
        self.formulas.append(formula)

    def _item(self, kind: int, flush: int) -> None:
        self.items.append((kind, len(self.order), flush))
        self.item_protos.append((self.step, self.phase, NO_BLOCK, self.module, self.item_category[flush].value, ""))

    def _formula(self, nbytes: Sized) -> int:
        return self.formula_ids.setdefault(nbytes.formula, len(self.formula_ids))


class Program:
    """A recorded walk, evaluated at any W whose sub-groups end where the recorded ones do (`frame`)."""

    def __init__(self, recorder: Recorder, source: pd.DataFrame, numels: list[int], trainable: list[int],
                 sub_group_size: int | None, ends: tuple[int, ...], group_lengths: tuple[int, ...]) -> None:
        self.numels = np.asarray(numels, dtype=np.int64)
        self.trainable = np.asarray(trainable, dtype=np.int64)
        self.sub_group_size, self.ends, self.group_lengths = sub_group_size, ends, group_lengths
        self.first_serial = recorder.first_serial
        self._fixed(recorder, source)
        self._formulas(list(recorder.formula_ids))
        self._variable(recorder)
        own = pd.DataFrame(recorder.protos + recorder.item_protos, columns=_STRING_COLUMNS)
        kept = source[_STRING_COLUMNS]
        self.pool = pd.concat([kept, own.astype(kept.dtypes.to_dict())], ignore_index=True)
        self.item_pool = len(source) + len(recorder.protos) + np.arange(len(recorder.items))

    def _fixed(self, r: Recorder, source: pd.DataFrame) -> None:
        order = np.asarray(r.order, dtype=np.int64)
        copied = order >= 0
        own = np.where(copied, 0, -1 - order)
        kinds = np.asarray(r.kinds, dtype=np.int64)
        self.pool_index = np.where(copied, order, len(source) + own)
        self.alloc = ~copied & (kinds[own] == _ALLOC)
        self.emit = ~copied & (kinds[own] != _LITERAL)  # left out when of zero bytes (EventWriter._emit)
        self.serial = np.where(copied, source["serial"].to_numpy()[np.where(copied, order, 0)],
                               np.asarray(r.serials, dtype=np.int64)[own])
        self.ref = np.where(copied, -1, np.asarray(r.refs, dtype=np.int64)[own])
        self.delta = np.where(copied, source["delta_bytes"].to_numpy()[np.where(copied, order, 0)],
                              np.asarray(r.literals, dtype=np.int64)[own])
        self.formula = np.where(copied, -1, np.asarray(r.formulas, dtype=np.int64)[own])
        self.sign = np.where(kinds[own] == _FREE, -1, 1)

    def _formulas(self, formulas: list[tuple]) -> None:
        """Every distinct sum of partitions as a segment of (parameter, coefficient) pairs; each formula's sum
        (or, for a "max" formula, its sums to take the largest of), W's power and scale."""
        sums: dict[tuple, int] = {}

        def sum_of(terms: tuple) -> int:
            return sums.setdefault(terms, len(sums))

        self.formula_sum = np.zeros(len(formulas), dtype=np.int64)
        self.maxima: list[tuple[int, list[int]]] = []
        for index, (terms, _, _) in enumerate(formulas):
            if terms and terms[0] == MAX_TERMS:
                self.maxima.append((index, [sum_of(group) for group in terms[1]]))
            else:
                self.formula_sum[index] = sum_of(terms)
        self.formula_k = np.asarray([k for _, k, _ in formulas], dtype=np.int64)
        self.formula_scale = np.asarray([scale for _, _, scale in formulas], dtype=np.int64)
        lengths = np.asarray([len(terms) for terms in sums], dtype=np.int64)
        self.sum_bounds = np.concatenate(([0], np.cumsum(lengths)))
        pairs = np.asarray([pair for terms in sums for pair in terms], dtype=np.int64).reshape(-1, 2)
        self.sum_param, self.sum_coef = pairs[:, 0], pairs[:, 1]

    def _variable(self, r: Recorder) -> None:
        items = np.asarray(r.items, dtype=np.int64).reshape(-1, 3)
        self.item_kind, self.item_at, self.item_flush = items[:, 0], items[:, 1], items[:, 2]
        self.flush_elem = np.asarray([elem for _, elem, _ in r.flushes], dtype=np.int64)
        self.flush_cat = np.asarray([formula for _, _, formula in r.flushes], dtype=np.int64)
        self.flush_size = np.asarray([len(params) for params, _, _ in r.flushes], dtype=np.int64)
        self.entry_flush = np.repeat(np.arange(len(r.flushes)), self.flush_size)
        self.entry_param = np.asarray([i for params, _, _ in r.flushes for i in params], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(self.flush_size)))[:-1]
        self.entry_index = np.arange(len(self.entry_param)) - np.repeat(starts, self.flush_size)
        self.flush_first_param = self.entry_param[starts] if len(starts) else starts
        self.block_item = np.flatnonzero(self.item_kind == _BLOCK)  # flush f's block item (in flush order)
        self.cat_free_item = np.flatnonzero(self.item_kind == _CAT_FREE)

    # ---- evaluation at W ------------------------------------------------------------------------------------
    def matches(self, world: int) -> bool:
        """Whether `world`'s sub-groups end where the recorded ones do (the rest of the structure is W's own)."""
        partition_numels = partitions(self.numels[self.trainable], world)
        return grouped_sub_group_ends(partition_numels.tolist(), self.sub_group_size,
                                      self.group_lengths) == self.ends

    def frame(self, world: int) -> pd.DataFrame:
        """The rank's timeline at `world` (which must match)."""
        part = partitions(self.numels, world)
        values = self._values(part, world)
        delta = self.delta.copy()
        sized = self.formula >= 0
        delta[sized] = self.sign[sized] * values[self.formula[sized]]
        return self._assemble(part, world, values, delta)

    def _values(self, part: np.ndarray, world: int) -> np.ndarray:
        cumulative = np.concatenate(([0], np.cumsum(self.sum_coef * part[self.sum_param])))
        sums = cumulative[self.sum_bounds[1:]] - cumulative[self.sum_bounds[:-1]]
        terms = sums[self.formula_sum]
        for index, groups in self.maxima:
            terms[index] = sums[groups].max()
        return self.formula_scale * np.where(self.formula_k == 1, world, 1) * terms

    def _assemble(self, part: np.ndarray, world: int, values: np.ndarray, fixed_delta: np.ndarray) -> pd.DataFrame:
        """Fixed rows and generated blocks in order; serials numbered in allocation order; zero-byte events out."""
        n_flush = len(self.flush_elem)
        numel, partition = self.numels[self.entry_param], part[self.entry_param]
        first, held = np.divmod(numel, partition)
        count = world - first  # ranks first..W-1 pad (`_paddings`)
        pads = np.bincount(self.entry_flush, weights=count, minlength=n_flush).astype(np.int64)
        # `flush`: no torch.cat for a single parameter divisible by W
        cat = np.where((self.flush_size == 1) & (self.numels[self.flush_first_param] % world == 0), 0, 1)
        lengths = np.where(self.item_kind == _BLOCK, 2 * pads[self.item_flush] + cat[self.item_flush],
                           cat[self.item_flush])
        before = np.concatenate(([0], np.cumsum(lengths)))
        n_fixed = len(self.pool_index)
        fixed_at = np.arange(n_fixed) + before[np.searchsorted(self.item_at, np.arange(n_fixed), side="right")]
        item_start = self.item_at + before[:-1]
        total = n_fixed + int(before[-1])
        pool_index = np.empty(total, dtype=np.int64)
        delta = np.empty(total, dtype=np.int64)
        alloc = np.zeros(total, dtype=bool)
        emit = np.ones(total, dtype=bool)
        pool_index[fixed_at], delta[fixed_at] = self.pool_index, fixed_delta
        alloc[fixed_at], emit[fixed_at] = self.alloc, self.emit
        # every row of an item takes the item's prototype
        item_rows = np.repeat(np.arange(len(lengths)), lengths)
        starts_of_rows = np.repeat(item_start, lengths)
        item_offsets = np.arange(len(item_rows)) - np.repeat(before[:-1], lengths)
        pool_index[starts_of_rows + item_offsets] = self.item_pool[item_rows]
        # the paddings, rank by rank and parameter by parameter within each flush
        entry = np.repeat(np.arange(len(count)), count)
        rank = first[entry] + np.arange(len(entry)) - np.repeat(np.cumsum(count) - count, count)
        nbytes = np.where(rank == first[entry], partition[entry] - held[entry], partition[entry])
        flush = self.entry_flush[entry]
        nbytes = nbytes * self.flush_elem[flush]
        order = np.lexsort((self.entry_index[entry], rank, flush))
        flush, nbytes = flush[order], nbytes[order]
        t = np.arange(len(flush)) - (np.cumsum(pads) - pads)[flush]
        block_start = item_start[self.block_item]
        pad_alloc = block_start[flush] + t
        pad_free = pad_alloc + pads[flush] + cat[flush]
        has_cat = np.flatnonzero(cat)
        cat_alloc = block_start[has_cat] + pads[has_cat]
        cat_free = item_start[self.cat_free_item][has_cat]
        cat_bytes = values[self.flush_cat[has_cat]]
        alloc[pad_alloc] = True
        alloc[cat_alloc] = True
        delta[pad_alloc], delta[pad_free] = nbytes, -nbytes
        delta[cat_alloc], delta[cat_free] = cat_bytes, -cat_bytes
        # serials: each allocation the next one; a free its allocation's
        numbered = self.first_serial + np.cumsum(alloc) - 1
        serial = np.empty(total, dtype=np.int64)
        own = self.ref >= 0
        serial[fixed_at] = np.where(self.alloc, numbered[fixed_at], self.serial)
        serial[fixed_at[own]] = numbered[fixed_at[self.ref[own]]]
        serial[pad_alloc] = serial[pad_free] = numbered[pad_alloc]
        serial[cat_alloc] = serial[cat_free] = numbered[cat_alloc]
        keep = ~emit | (delta != 0)
        return self._frame(pool_index[keep], serial[keep], delta[keep])

    def _frame(self, pool_index: np.ndarray, serial: np.ndarray, delta: np.ndarray) -> pd.DataFrame:
        columns = {}
        for column in TIMELINE_COLUMNS:
            if column == "serial":
                columns[column] = serial
            elif column == "delta_bytes":
                columns[column] = delta
            else:
                columns[column] = self.pool[column].array.take(pool_index)
        return pd.DataFrame(columns, copy=False)
