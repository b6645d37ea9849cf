"""Attention over the block-paged KV cache, behind one switch: torch SDPA or vllm-flash-attn.

Tokens of one forward are flat: run i of the batch holds `q_lens[i]` new tokens of a sequence
whose KV lives in the blocks `tables[i]` (pipeline.models.kv_cache: token p at row
p % block_size of block tables[i][p // block_size]), at positions
`starts[i] .. starts[i] + q_lens[i] - 1`. `build_metadata` turns that into everything the
kernels need, once per forward (not per layer).

- "sdpa": `torch.nn.functional.scaled_dot_product_attention`, any device. Runs are padded
  to [B, T]; each run's keys are gathered through its block table (one index_select of whole
  blocks per layer, [B, Lk] keys); a boolean mask [B, 1, T, Lk] gives causal order and hides
  keys past each run's length. Decode and verify steps (T <= FOLD_MAX_T) fold the GQA group and the
  run's tokens into the query axis so one matmul per KV head serves all its query heads; a
  decode of equal lengths needs no mask. A forward that mixes prompts (runs over FOLD_MAX_T)
  with decode/verify runs attends each group on its own (`AttnMetadata.groups`), so the
  engine can prefill in the decode step's forward without padding decodes to a prompt; so do
  decode/verify runs of very different lengths (`split_runs`: a long draft next to decodes).
- "flash": `flash_attn_varlen_func` of vllm-flash-attn 2.6.2 on CUDA over the paged cache
  itself: `block_table` [B, max_blocks] int32 (each run's table, padded with block 0, never
  read past the run's keys), key lengths as `cu_seqlens_k`, the cumulative run lengths (that
  release has no `seqused_k`). Causal masking is bottom-right aligned there, which is what a
  run appended at the end of its sequence needs. Varlen rather than `flash_attn_with_kvcache`: the kvcache kernel takes q
  as [B, T, H, D], so a batch mixing a long prefill with decodes would pad every run to the
  prefill's length; varlen packs the runs as they are. Importing this module never imports
  flash-attn.

torch >= 2.4 (the vllm-flash-attn wheel pins 2.4.0): SDPA's `enable_gqa` (2.5+) is used
only when present; otherwise KV heads are repeated to the query heads.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "flash")
FLASH_PAGE_MULTIPLE = 16  # vllm-flash-attn paged KV wants block sizes divisible by 16
# SDPA folds runs up to this long onto the query axis (decode and verify windows); a longer
# prefill keeps its [B, H, T, D] layout (its folded mask would grow by the GQA group).
FOLD_MAX_T = 16
# Decode/verify runs of different lengths get SDPA calls of their own when that saves at least
# this many padded query rows (and half of them; see `split_runs`).
SPLIT_MIN_ROWS = 8
# SDPA grew `enable_gqa` in torch 2.5; on 2.4 the GQA prefill path repeats KV heads instead.
SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


@functools.cache
def flash_import_error() -> str | None:
    """None when vllm_flash_attn imports (its CUDA extension loads), else why not."""
    try:
        import vllm_flash_attn  # noqa: F401
    except (ImportError, OSError) as exc:  # absent, or its .so does not load (torch ABI, CUDA)
        return f"{type(exc).__name__}: {exc}"
    return None


def flash_available() -> bool:
    return torch.cuda.is_available() and flash_import_error() is None


def resolve_backend(backend: str, device: str | torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'flash' only on CUDA with vllm-flash-attn installed and a 16-bit dtype."""
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
    batch: int                      # B runs
    max_q: int                      # T = longest run
    max_k: int                      # Lk = longest run's key count after this forward
    write_idx: torch.Tensor         # [N] long, block * block_size + row, into a flat cache
    positions: torch.Tensor         # [N] long, position of each new token in its sequence
    block_table: torch.Tensor       # [B, max_blocks] int32, run i's blocks (padded with 0)
    pad_idx: torch.Tensor | None = None   # [N] long into batch*T; None: tokens already [B, T]
    mask: torch.Tensor | None = None      # [batch, 1, T, Lk] bool, True = attend
    causal: bool = False            # sdpa: runs all start at 0 with one length: is_causal
    # flash only
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32, cumulative run lengths
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32, cumulative key counts after this
    # sdpa, prefills next to decode/verify runs: (token indices, metadata) per group, each
    # attended on its own (one padded [B, T] over a prompt and 1-token decodes would pad
    # every decode to the prompt's length)
    groups: list[tuple[torch.Tensor, AttnMetadata]] | None = None


def build_metadata(backend: str, tables: list[list[int]], starts: list[int],
                   q_lens: list[int], block_size: int, device: torch.device | str
                   ) -> AttnMetadata:
    """Per-forward attention inputs. `starts[i]` is run i's key count before this forward;
    `tables[i]` holds at least ceil((starts[i] + q_lens[i]) / block_size) blocks."""
    b = len(tables)
    t = max(q_lens)
    k_lens = [s + q for s, q in zip(starts, q_lens)]
    lk = max(k_lens)
    used = [-(-k // block_size) for k in k_lens]  # blocks each run reads
    for table, k_len, n in zip(tables, k_lens, used):
        if len(table) < n:
            raise ValueError(f"attention: a block table of {len(table)} blocks cannot hold "
                             f"{k_len} keys (block size {block_size})")
    uniform = all(q == t for q in q_lens)
    # The index math in numpy, one torch.from_numpy per result: a dozen tiny torch ops cost
    # several microseconds each on CPU, more than the whole forward of a small batch.
    width = max(used)
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
    if t == 1:  # decode: one token per run
        run = np.arange(b)
        within = np.zeros(b, dtype=np.int64)
        positions = starts_np
    else:
        q_lens_np = np.array(q_lens, dtype=np.int64)
        run = np.repeat(np.arange(b), q_lens_np)  # run of each token
        within = np.arange(len(run)) - (np.cumsum(q_lens_np) - q_lens_np)[run]
        positions = starts_np[run] + within
    write_idx = table_np[run, positions // block_size] * block_size + positions % block_size
    meta = AttnMetadata(
        backend=backend, batch=b, max_q=t, max_k=lk, write_idx=_tensor(write_idx, device),
        positions=_tensor(positions, device),
        block_table=_tensor(table_np.astype(np.int32), device),
    )
    if backend == "flash":
        meta.cu_seqlens_q = _cumulative(q_lens).to(device)
        # With a block table only the differences matter (key i of run b is row i % page of
        # block block_table[b, i // page]), so cumulative key counts give each run its keys.
        meta.cu_seqlens_k = _cumulative(k_lens).to(device)
        return meta
    parts = split_runs(q_lens)
    if parts is not None:
        offsets = [0, *itertools.accumulate(q_lens)]
        meta.groups = []
        for runs in parts:
            tokens = [t for i in runs for t in range(offsets[i], offsets[i + 1])]
            sub = build_metadata(backend, [tables[i] for i in runs], [starts[i] for i in runs],
                                 [q_lens[i] for i in runs], block_size, device)
            meta.groups.append((torch.tensor(tokens, device=device), sub))
        return meta
    if not uniform:  # mixed lengths: scatter each token to its run's row of the padded query
        meta.pad_idx = _tensor(run * t + within, device)
    if t == 1 and all(k == lk for k in k_lens):
        return meta  # decode, same lengths: every gathered key is visible
    if uniform and not any(starts):
        meta.causal = True  # equal-length prefills from position 0: plain causal attention
        return meta
    q_pos = np.arange(t)[None, :] + starts_np[:, None]                         # [B, T]
    k_pos = np.arange(lk)
    k_len = np.array(k_lens, dtype=np.int64)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < k_len[:, None, None])
    meta.mask = _tensor(mask[:, None], device)
    return meta


def _tensor(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A numpy result as a tensor on `device` (CPU: shares the array, no copy)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def split_runs(q_lens: list[int]) -> list[list[int]] | None:
    """Runs (indices, in order) attended by separate SDPA calls, or None for one call. Prompts
    (over FOLD_MAX_T) apart from decode/verify runs; decode/verify runs of different lengths
    apart where that saves at least SPLIT_MIN_ROWS padded query rows and half of them: one
    SDPA call pads every run to the longest, so at batch 8 one request verifying 8 drafts next
    to seven decodes cost as much attention as eight 9-token runs (SmolLM2, CPU, 300 cached
    tokens: 47 ms a forward against 22 for eight decodes; split, the forward took 0.89-0.90x,
    and four 9-token runs among 32 0.85x). Splits that saved 33-44% of the rows measured
    0.95-1.04x, within the noise: the second call costs about what they save. Two groups at
    most per call; each group is split again the same way."""
    b = len(q_lens)
    long = [i for i in range(b) if q_lens[i] > FOLD_MAX_T]
    if long:
        return [[i for i in range(b) if q_lens[i] <= FOLD_MAX_T], long] if len(long) < b else None
    order = sorted(range(b), key=lambda i: q_lens[i])
    longest = q_lens[order[-1]]
    padded = b * longest
    best, cut = padded - max(SPLIT_MIN_ROWS, padded / 2), None
    for j in range(1, b):  # the j shortest runs apart, padded to the j-th's length
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
    """Store new keys/values k, v [N, KH, D] into caches [blocks, block_size, KH, D] at
    meta.write_idx."""
    nb, bs, kh, d = k_cache.shape
    k_cache.view(nb * bs, kh, d).index_copy_(0, meta.write_idx, k)
    v_cache.view(nb * bs, kh, d).index_copy_(0, meta.write_idx, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
           scale: float) -> torch.Tensor:
    """q [N, H, D] against the cache (new KV already written) -> [N, H*D]."""
    if meta.backend == "flash":
        return _attend_flash(q, k_cache, v_cache, meta, scale)
    if meta.groups is not None:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for tokens, sub in meta.groups:
            out[tokens] = attend(q[tokens], k_cache, v_cache, sub, scale)  # may split again
        return out
    return _attend_sdpa(q, k_cache, v_cache, meta, scale)


def _gather(cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """[blocks, bs, KH, D] -> [B, KH, Lk, D]: each run's blocks in table order."""
    _nb, bs, kh, d = cache.shape
    b, width = meta.block_table.shape
    blocks = cache.index_select(0, meta.block_table.view(-1).long())    # [B*width, bs, KH, D]
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
    if t <= FOLD_MAX_T and not meta.causal:
        # Decode and verify: a KV head's query heads and the run's tokens share the query
        # axis -> [B, KH, T*G, D], so K/V are read once per KV head, never repeated per query
        # head (SDPA's GQA on CPU repeats them: a verify of 8 runs with one 2-token draft
        # took 2.3x or more the attention time of a decode; folded, about the same).
        g = h // kh
        qg = qp.reshape(b, t, kh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kh, t * g, d)
        if mask is not None:
            mask = mask[:, :, :, None].expand(b, 1, t, g, meta.max_k).reshape(
                b, 1, t * g, meta.max_k)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out = out.reshape(b, kh, t, g, d).permute(0, 2, 1, 3, 4).reshape(b * t, h * d)
    else:
        qh = qp.reshape(b, t, h, d).transpose(1, 2)                     # [B, H, T, D]
        gqa = {}
        if kh != h and SDPA_HAS_GQA:
            gqa["enable_gqa"] = True
        elif kh != h:
            k = k.repeat_interleave(h // kh, dim=1)  # query head j reads KV head j // group
            v = v.repeat_interleave(h // kh, dim=1)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=meta.causal,
                                             scale=scale, **gqa)
        out = out.transpose(1, 2).reshape(b * t, h * d)
    if meta.pad_idx is not None:
        out = out[meta.pad_idx]
    return out


def _attend_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttnMetadata, scale: float) -> torch.Tensor:
    from vllm_flash_attn import flash_attn_varlen_func  # CUDA only; checked in resolve_backend

    # k_cache [blocks, bs, KH, D] is the paged cache; run b's pages are block_table[b].
    out = flash_attn_varlen_func(
        q.contiguous(), k_cache, v_cache,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_k,
        softmax_scale=scale, causal=True, block_table=meta.block_table,
    )
    return out.reshape(q.shape[0], -1)
