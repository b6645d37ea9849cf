"""Attention over the block-paged KV cache: torch SDPA ("sdpa", any device) or the varlen kernel
of vllm-flash-attn 2.6.2 ("flash", CUDA, reads the paged cache through `block_table`).

A forward's tokens are flat: run i holds `q_lens[i]` new tokens at positions `starts[i]` on, its
KV in the blocks `tables[i]` (token p at row p % block_size of block tables[i][p // block_size]).

The batch-invariant SDPA path (`invariant_group`, CPU float32): a query's output is the same bits
whatever else the forward holds (decode, verify window, prefill chunk, other requests). Today's
path is not: the CPU flash kernel's matmuls sum in another order for 1-3 rows than for more, and
its sums over a row's keys depend on the key count. So every call keeps each shape a row sees
in a class the kernels sum alike (found by probing torch 2.13 + MKL, held by
tests/models/test_attention_invariant.py): at least 4 query rows in each of the kernel's
query blocks, and keys padded (masked) to a multiple of 16 whose last 512-key block is not
193-383 long (MKL splits such a block's sum in halves; others in fixed 192-key steps).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "flash")
FLASH_PAGE_MULTIPLE = 16  # vllm-flash-attn paged KV wants block sizes divisible by 16
# Runs up to this long (decode, verify) fold onto SDPA's query axis; a prefill's folded mask
# would grow by the GQA group.
FOLD_MAX_T = 16
SPLIT_MIN_ROWS = 8
# The CPU flash kernel (torch 2.13): query blocks of 32/64/256 rows (from 192/768 rows on), key
# blocks of KV_SPLIT; MKL's float32 matmul sums alike for every row count from INVARIANT_MIN_ROWS.
KV_SPLIT = 512
INVARIANT_MIN_ROWS = 4
INVARIANT_KEY_MULTIPLE = 16  # the kernel's exp-sum runs in 16-float vectors and a scalar tail
SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


@functools.cache
def flash_import_error() -> str | None:
    try:
        import vllm_flash_attn  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: its .so does not load (torch ABI, CUDA)
        return f"{type(exc).__name__}: {exc}"
    return None


def flash_available() -> bool:
    return torch.cuda.is_available() and flash_import_error() is None


def resolve_backend(backend: str, device: str | torch.device, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        return "flash" if on_cuda and half and flash_available() else "sdpa"
    if backend == "flash":
        if not on_cuda or not torch.cuda.is_available():
            raise ValueError("attention backend 'flash' needs a CUDA device")
        if flash_import_error() is not None:
            raise ValueError("attention backend 'flash' needs the vllm-flash-attn package "
                             f"(pip install '.[gpu]'): {flash_import_error()}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention backend 'flash' needs float16/bfloat16, got {dtype}")
    return backend


@dataclass
class AttnMetadata:
    backend: str
    batch: int
    max_q: int
    max_k: int                      # the longest run's key count after this forward
    write_idx: torch.Tensor         # [N] block * block_size + row, into the flat cache
    positions: torch.Tensor
    block_table: torch.Tensor       # [B, max_blocks] int32, padded with block 0
    pad_idx: torch.Tensor | None = None   # [N] into batch * T; None: tokens already [B, T]
    mask: torch.Tensor | None = None      # [B, 1, T, Lk] bool, True = attend
    causal: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    groups: list[tuple[torch.Tensor, AttnMetadata]] | None = None
    invariant: bool = False  # the batch-invariant path: always folded and masked, one thread
    _folded: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def folded_mask(self, group: int) -> torch.Tensor:
        """`mask` on the folded query axis [B, 1, T * group, Lk]: built once a forward, not once
        a layer."""
        mask = self._folded.get(group)
        if mask is None:
            b, t, k = self.batch, self.max_q, self.max_k
            mask = self.mask[:, :, :, None].expand(b, 1, t, group, k).reshape(b, 1, t * group, k)
            self._folded[group] = mask
        return mask


def invariant_keys(n: int) -> int:
    """The key count a batch-invariant call pads `n` keys to (the rest masked)."""
    keys = -(-n // INVARIANT_KEY_MULTIPLE) * INVARIANT_KEY_MULTIPLE
    tail = keys % KV_SPLIT
    return keys + 384 - tail if 192 < tail < 384 else keys


def invariant_rows(t: int, group: int) -> int:
    """Tokens a run is padded to so that each of the kernel's query blocks over its t * group
    folded rows holds at least INVARIANT_MIN_ROWS."""
    while True:
        rows = t * group
        split = 256 if rows >= 768 else 64 if rows >= 192 else 32
        if rows >= INVARIANT_MIN_ROWS and not 0 < rows % split < INVARIANT_MIN_ROWS:
            return t
        t += 1


def build_metadata(backend: str, tables: list[list[int]], starts: list[int],
                   q_lens: list[int], block_size: int, device: torch.device | str,
                   invariant_group: int | None = None) -> AttnMetadata:
    """Once per forward, not per layer. `starts[i]` is run i's key count before this forward.
    `invariant_group` (query heads per KV head): the batch-invariant SDPA path."""
    b = len(tables)
    t = max(q_lens)
    k_lens = [s + q for s, q in zip(starts, q_lens)]
    lk = max(k_lens)
    used = [-(-k // block_size) for k in k_lens]
    for table, k_len, n in zip(tables, k_lens, used):
        if len(table) < n:
            raise ValueError(f"attention: a block table of {len(table)} blocks cannot hold "
                             f"{k_len} keys (block size {block_size})")
    invariant = invariant_group is not None and backend == "sdpa"
    if invariant:
        t = invariant_rows(t, invariant_group)
        lk = invariant_keys(lk)
    uniform = all(q == t for q in q_lens)
    # Index math in numpy: a dozen tiny torch ops cost more on CPU than a small batch's forward.
    # The invariant path's padded keys read block 0 (masked).
    width = -(-lk // block_size) if invariant else max(used)
    table_np = np.zeros((b, width), dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(tb[:n] for tb, n in zip(tables, used)),
                       dtype=np.int64, count=sum(used))
    if width == 1:
        table_np[:, 0] = flat
    else:
        used_np = np.array(used, dtype=np.int64)
        table_np[np.repeat(np.arange(b), used_np),
                 np.arange(len(flat)) - np.repeat(np.cumsum(used_np) - used_np, used_np)] = flat
    starts_np = np.array(starts, dtype=np.int64)
    if t == 1:
        run = np.arange(b)
        within = np.zeros(b, dtype=np.int64)
        positions = starts_np
    else:
        q_lens_np = np.array(q_lens, dtype=np.int64)
        run = np.repeat(np.arange(b), q_lens_np)
        within = np.arange(len(run)) - (np.cumsum(q_lens_np) - q_lens_np)[run]
        positions = starts_np[run] + within
    write_idx = table_np[run, positions // block_size] * block_size + positions % block_size
    meta = AttnMetadata(
        backend=backend, batch=b, max_q=t, max_k=lk, write_idx=_tensor(write_idx, device),
        positions=_tensor(positions, device),
        block_table=_tensor(table_np.astype(np.int32), device), invariant=invariant,
    )
    if backend == "flash":
        meta.cu_seqlens_q = _cumulative(q_lens).to(device)
        # No seqused_k in this release; with a block table cumulative key counts serve.
        meta.cu_seqlens_k = _cumulative(k_lens).to(device)
        return meta
    parts = split_runs(q_lens)
    if parts is not None:
        offsets = [0, *itertools.accumulate(q_lens)]
        meta.groups = []
        for runs in parts:
            tokens = [t for i in runs for t in range(offsets[i], offsets[i + 1])]
            sub = build_metadata(backend, [tables[i] for i in runs], [starts[i] for i in runs],
                                 [q_lens[i] for i in runs], block_size, device, invariant_group)
            meta.groups.append((torch.tensor(tokens, device=device), sub))
        return meta
    if not uniform:
        meta.pad_idx = _tensor(run * t + within, device)
    # The invariant path always masks: is_causal and mask-free calls take other kernel paths.
    if not invariant and t == 1 and all(k == lk for k in k_lens):
        return meta  # every gathered key is visible
    if not invariant and uniform and not any(starts):
        meta.causal = True
        return meta
    q_pos = np.arange(t)[None, :] + starts_np[:, None]
    k_pos = np.arange(lk)
    k_len = np.array(k_lens, dtype=np.int64)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < k_len[:, None, None])
    meta.mask = _tensor(mask[:, None], device)
    return meta


def _tensor(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def split_runs(q_lens: list[int]) -> list[list[int]] | None:
    """Runs (indices, in order) for separate SDPA calls, or None for one call. One call pads
    every run to the longest, so prompts go apart from decode/verify runs, and short runs apart
    from long ones where that saves SPLIT_MIN_ROWS padded rows and half of them (smaller savings
    cost about what the second call does). Two groups a call; each may split again."""
    b = len(q_lens)
    long = [i for i in range(b) if q_lens[i] > FOLD_MAX_T]
    if long:
        return [[i for i in range(b) if q_lens[i] <= FOLD_MAX_T], long] if len(long) < b else None
    order = sorted(range(b), key=lambda i: q_lens[i])
    longest = q_lens[order[-1]]
    padded = b * longest
    best, cut = padded - max(SPLIT_MIN_ROWS, padded / 2), None
    for j in range(1, b):
        lo = q_lens[order[j - 1]]
        rows = j * lo + (b - j) * longest
        if lo < q_lens[order[j]] and rows <= best:
            best, cut = rows, j
    return None if cut is None else [sorted(order[:cut]), sorted(order[cut:])]


def _cumulative(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return cu


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMetadata) -> None:
    nb, bs, kh, d = k_cache.shape
    k_cache.view(nb * bs, kh, d).index_copy_(0, meta.write_idx, k)
    v_cache.view(nb * bs, kh, d).index_copy_(0, meta.write_idx, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
           scale: float) -> torch.Tensor:
    """q [N, H, D] against the cache, this forward's KV already written -> [N, H*D]."""
    if meta.backend == "flash":
        return _attend_flash(q, k_cache, v_cache, meta, scale)
    if meta.invariant and torch.get_num_threads() > 1:
        # The kernel's per-thread scratch sits at another alignment in each thread, and MKL sums
        # differently at another alignment: which thread gets a row depends on the batch.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return attend(q, k_cache, v_cache, meta, scale)
        finally:
            torch.set_num_threads(threads)
    if meta.groups is not None:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for tokens, sub in meta.groups:
            out[tokens] = attend(q[tokens], k_cache, v_cache, sub, scale)
        return out
    return _attend_sdpa(q, k_cache, v_cache, meta, scale)


def _gather(cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    _nb, bs, kh, d = cache.shape
    b, width = meta.block_table.shape
    blocks = cache.index_select(0, meta.block_table.view(-1).long())
    return blocks.view(b, width * bs, kh, d)[:, :meta.max_k].transpose(1, 2)


def _attend_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttnMetadata, scale: float) -> torch.Tensor:
    _n, h, d = q.shape
    kh = k_cache.shape[2]
    b, t = meta.batch, meta.max_q
    if meta.pad_idx is not None:
        qp = q.new_zeros(b * t, h, d)
        qp[meta.pad_idx] = q
    else:
        qp = q
    k = _gather(k_cache, meta)
    v = _gather(v_cache, meta)
    mask = meta.mask
    if meta.invariant or (t <= FOLD_MAX_T and not meta.causal):
        # A KV head's query heads and the run's tokens share the query axis [B, KH, T*G, D]:
        # K/V are read once per KV head (SDPA's own GQA on CPU repeats them per query head).
        g = h // kh
        qg = qp.reshape(b, t, kh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kh, t * g, d)
        if mask is not None:
            mask = meta.folded_mask(g)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out = out.reshape(b, kh, t, g, d).permute(0, 2, 1, 3, 4).reshape(b * t, h * d)
    else:
        qh = qp.reshape(b, t, h, d).transpose(1, 2)
        gqa = {}
        if kh != h and SDPA_HAS_GQA:
            gqa["enable_gqa"] = True
        elif kh != h:
            k = k.repeat_interleave(h // kh, dim=1)
            v = v.repeat_interleave(h // kh, dim=1)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=meta.causal,
                                             scale=scale, **gqa)
        out = out.transpose(1, 2).reshape(b * t, h * d)
    if meta.pad_idx is not None:
        out = out[meta.pad_idx]
    return out


def _attend_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttnMetadata, scale: float) -> torch.Tensor:
    from vllm_flash_attn import flash_attn_varlen_func

    # Varlen, not flash_attn_with_kvcache: that one takes q as [B, T, H, D], padding every
    # decode next to a prefill to the prefill's length.
    out = flash_attn_varlen_func(
        q.contiguous(), k_cache, v_cache,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_k,
        softmax_scale=scale, causal=True, block_table=meta.block_table,
    )
    return out.reshape(q.shape[0], -1)
