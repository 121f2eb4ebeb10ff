"""Runs one scheduled step on the model: the only engine part that touches torch tensors.

It receives a :class:`SchedulerOutput` and nothing else (STYLE rule 3), owns the model, the
KV block pools and per-request state (tokens, block tables, seeded generator, grammar matcher;
a request's first chunk brings it, later chunks only their changes), and returns the sampled
tokens. It knows nothing of queues or of how blocks were chosen.

One pool per KV group (``ModelConfig.kv_groups``), each block-major as attention.py draws it::

    kv_caches[0]  [num_blocks,        L_full,    2, B, kv_heads, head_dim]   every layer, or a
                                                                           hybrid's full-attention ones
    kv_caches[1]  [num_window_blocks, L_sliding, 2, B, kv_heads, head_dim]   a hybrid's sliding-window
                                                                           layers (block 0: NULL)

A hybrid's full-attention pool has one block more at its end, written and never read: a bounded
replay's full-attention K/V go there (NewRequest.replay_until), so the cached KV stays exact.

A step builds one :class:`AttentionMetadata` per group (slot rows and tables differ, the chunks
do not) and each layer attends over its group's pool with its index inside the group.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.config import check
from services.engine.attention import AttentionMetadata, BlockTable, build_metadata
from services.engine.grammar import GrammarMatchers
from services.engine.host_memory import huge_page_zeros
from services.engine.kernels import select as kernel_select
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM, rope_inv_freq
from services.common.sampling_params import TokenLogprobs
from services.engine.sampler import Sampler, SamplingRow
from services.engine.scheduler_output import NewRequest, ScheduledChunk, SchedulerOutput
from services.engine.sequence import BlockId, RequestId
from services.engine.threads import ThreadPlacement


MAX_PACKED_ROWS = 64
"""Most rows a step with speculative drafts multiplies by the packed weights (decode-only steps
always do, up to max_num_seqs rows); more go to MKL, faster for many rows."""


class RequestState:
    """What the runner holds of a request between steps."""

    def __init__(self, new: NewRequest) -> None:
        self.params = new.params
        self.grammar = new.grammar
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids = list(new.output_token_ids)
        self.replay_until = new.replay_until
        self.block_tables = [BlockTable()]
        """One per KV group."""

    def update(self, chunk: ScheduledChunk) -> None:
        self.output_token_ids.extend(chunk.new_token_ids)
        self.block_tables[0].update(chunk.num_kept_blocks, chunk.new_block_ids)
        for group, change in enumerate(chunk.other_tables, 1):
            if group == len(self.block_tables):
                self.block_tables.append(BlockTable())
            self.block_tables[group].update(change.num_kept, change.new_block_ids)


@dataclass
class ModelRunnerOutput:
    sampled: dict[RequestId, list[int]]
    """Each sampling chunk's new tokens: one, or the verified drafts and the token after them."""
    logprobs: dict[RequestId, list[TokenLogprobs | None]]
    """Aligned with ``sampled``; None entries for requests that asked for no logprobs."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, published: str = "float32", exact: bool = False) -> torch.dtype:
    """``dtype`` ("auto" or a torch name) for a model published in ``published`` (ModelConfig.dtype).

    auto: bf16 on CUDA; on the CPU bf16 where it pays, fp32 elsewhere. It pays where the model
    was published in 16 bits (an fp32 checkpoint stays fp32, as vLLM's auto keeps it) and the
    CPU computes bf16 products natively and faster than fp32 (:func:`cpu_computes_bf16`):
    SmolLM2's generated tokens a second (benchmarks/engine_throughput.py), 2 cores, ~1.8x fp32's
    on an AMD Zen 4 (AVX512_BF16), ~1.8x on an Intel Xeon with AMX; without them torch emulates
    bf16, slower than fp32. ``exact``: a mode that needs fp32 (exact prefill) keeps fp32 on the CPU.
    """
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    native = published in ("bfloat16", "float16") and not exact and cpu_computes_bf16()
    return torch.bfloat16 if native else torch.float32


def cpu_computes_bf16() -> bool:
    """bf16 pays on this CPU and keeps the engine's guarantees: the kernels' packed bf16 product
    was built here (AVX512_BF16, on AMX's tiles where the CPU has them), whose row's bits do not
    depend on the batch, as fp32's, and it runs faster than fp32 (kernels/select.bf16_pays: on
    AMX, and on AVX512_BF16 but on Intel's, whose dot products alone are slower than its fp32).
    Without the kernels (no C compiler, ``EPD_CPU_KERNELS=0``) auto stays fp32."""
    kernels = kernel_select.kernels_for("cpu")
    return kernels is not None and kernel_select.bf16_pays(kernels.bf16_product, kernel_select.cpu_vendor())


def product_kernel(device: torch.device, dtype: torch.dtype, packed_by=None) -> str:
    """A name for what multiplies by the weights: the CPU kernels' packed product (``packed_by``,
    their CpuKernels) or torch's own (MKL, oneDNN or cuBLAS)."""
    if packed_by is not None:
        return "packed-fp32" if dtype == torch.float32 else f"packed-{packed_by.bf16_product}"
    if device.type == "cuda":
        return "cublas"
    if dtype == torch.float32:
        return "mkl" if torch.backends.mkl.is_available() else "torch"
    return "onednn" if torch.backends.mkldnn.is_available() else "torch"


@functools.cache
def keep_heap_pages() -> bool:
    """Have glibc serve blocks up to 32 MiB from the heap and keep what is freed there.

    A step's activations (up to ~25 MiB each at 2,048 tokens) are freed and allocated again
    every step. By default glibc maps the larger ones afresh and trims the heap, so the next
    step faults the same memory in again, page by page: measured over the offline benchmark,
    ~300K page faults and ~2.4 s of kernel time in most runs, against ~25K and ~0.6 s with this.
    The process keeps its peak heap instead (a server's steady state anyway). Process-wide, set
    once; False where the C library is not glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, group: int = 0) -> int:
    """Bytes of one block of KV group ``group``'s pool (all its layers)."""
    num_layers = len(cfg.kv_groups[group])
    return num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def pool_sizes(cfg: ModelConfig, num_blocks: int, num_window_blocks: int) -> list[int]:
    """Blocks of each KV group's pool as the runner lays them out: a hybrid's full-attention
    pool has one block more (the discard block), its window pool already counts its NULL."""
    return [num_blocks] if not cfg.has_window_pool else [num_blocks + 1, num_window_blocks]


def pools_bytes(cfg: ModelConfig, num_blocks: int, num_window_blocks: int, block_size: int,
                dtype: torch.dtype) -> list[int]:
    """Bytes of each pool, in the order one external buffer holds them (ModelRunner)."""
    return [n * kv_block_bytes(cfg, block_size, dtype, group)
            for group, n in enumerate(pool_sizes(cfg, num_blocks, num_window_blocks))]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: tuple[int, ...] = (), kv_buffer=None, batch_invariant: bool = False,
                 num_window_blocks: int = 0, cpu_threads: list[int] | None = None, nice: int = 0,
                 exact_prefill: bool = False) -> None:
        """``num_blocks``: group 0's pool; ``num_window_blocks``: a hybrid model's sliding-window
        pool (its NULL block included); ``cpu_threads``: the CPUs a CPU engine's compute threads
        are bound to (threads.py), None leaves torch's threads as they are; ``nice``: the
        priority of the threads that run the model (threads.py); ``exact_prefill``: see
        EngineConfig."""
        self.cfg = cfg
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        self.eos_token_ids = tuple(eos_token_ids)
        if device.type == "cpu":
            keep_heap_pages()
        # Built uninitialised on the CPU (no random init to pay for), filled, then moved.
        model = LlamaForCausalLM(cfg)
        model.load_weights(weights)
        self.model = model.to(device=device, dtype=dtype).eval()
        # After .to(dtype): RoPE frequencies stay fp32 like Hugging Face's.
        self.model.inv_freq = rope_inv_freq(cfg).to(device)
        groups = cfg.kv_groups
        assert (len(groups) > 1) == (num_window_blocks > 0), "a window pool exactly for a hybrid model"
        # A hybrid's full-attention pool has one block more, that nothing reads: where a bounded
        # replay writes the full-attention K/V it must not keep (NewRequest.replay_until).
        self._discard_block = num_blocks if len(groups) > 1 else -1
        shapes = [(n, len(layers), 2, block_size, cfg.num_kv_heads, cfg.head_dim)
                  for n, layers in zip(pool_sizes(cfg, num_blocks, num_window_blocks), groups)]
        self.pool_offsets = [0]
        """Byte offset of each pool in the buffer that holds them all (a registered region)."""
        for size in pools_bytes(cfg, num_blocks, num_window_blocks, block_size, dtype)[:-1]:
            self.pool_offsets.append(self.pool_offsets[-1] + size)
        if kv_buffer is not None:
            # A registered memory region (shared memory the transfer engine reads one-sided):
            # the pools are views of it, one after the other, already touched by its allocator.
            assert device.type == "cpu", "an external KV buffer is host memory"
            raw = torch.frombuffer(kv_buffer, dtype=torch.uint8)
            self.kv_caches = [raw[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                              for offset, shape in zip(self.pool_offsets, shapes)]
        else:
            # Zero-filled, so every page of the pool is touched now rather than mid-request; on
            # the CPU in huge pages where the kernel gives them (host_memory.py).
            self.kv_caches = [huge_page_zeros(shape, dtype) if device.type == "cpu"
                              else torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.kv_cache = self.kv_caches[0]
        self._group_num_layers = [len(layers) for layers in groups]
        self._gather_buffer = self.kv_cache.new_empty((2, 0) + tuple(self.kv_cache.shape[3:]))
        # Where the CPU's kernels exist (fp32, bf16), attention reads blocks in place, and decode
        # steps use packed weights (bf16 ones where the CPU has AVX512_BF16); on CUDA the Triton
        # kernels read blocks in place; else torch runs it all (no C compiler, no triton, or
        # turned off).
        self.attention_backend = kernel_select.attention_backend(device, dtype)
        self._kernels = kernel_select.kernels_for(self.attention_backend)
        on_kernels = self.attention_backend == "cpu"
        # Unless prefill must be transformers' arithmetic: fresh prompts through the CPU's
        # attention kernel, every RMSNorm (and the add before it) in one C pass.
        self._fresh_in_kernel = on_kernels and not exact_prefill
        if self._fresh_in_kernel:
            self.model.fuse_norms(self._kernels)
        # The packed product where the kernels have one for the dtype: fp32, and bf16 where it was
        # built (AVX512_BF16; on AMX's tiles where the CPU has them); else torch's (oneDNN, cuBLAS).
        packs = on_kernels and (dtype == torch.float32 or (dtype == torch.bfloat16 and self._kernels.packs_bf16))
        check(not batch_invariant or (packs and not exact_prefill), "batch_invariant",
              f"needs the CPU's packed product for every step (device cpu, float32 or a bfloat16 the CPU "
              f"computes natively, a C compiler) and prompts not in exact_prefill's batch-dependent "
              f"arithmetic; this engine runs {self.attention_backend} attention on "
              f"{device}/{str(dtype).removeprefix('torch.')}{', exact_prefill' if exact_prefill else ''}")
        packed_prompts = packs and not exact_prefill and (batch_invariant or kernel_select.packed_prompts())
        if packs:
            self.model.pack(self._kernels, every_step=packed_prompts)
        self.prompt_products = "packed" if packed_prompts else "torch"
        self.product_kernels = (product_kernel(device, dtype, self._kernels if packed_prompts else None),
                                product_kernel(device, dtype, self._kernels if packs else None))
        """What multiplies by the weights in steps with prompt tokens, and in steps that only decode."""
        self.is_batch_invariant = packed_prompts
        """A request's output is the same alone or in any batch, however its prompt was chunked,
        cached or handed over, and when it is preempted or migrated: every product is packed (a
        row's bits never depend on the other rows) and every token attends through its role's
        kernel (attention.build_metadata). ``batch_invariant`` makes it a requirement."""
        self.threads = None
        cpu_threads = cpu_threads if device.type == "cpu" else None
        if cpu_threads is not None or nice:
            kernels = kernel_select.cpu.kernels() if cpu_threads is not None else None
            self.threads = ThreadPlacement(cpu_threads, kernels.bind_threads if kernels else None, nice)
        self.sampler = Sampler()
        self._requests: dict[RequestId, RequestState] = {}
        self._generators: dict[RequestId, torch.Generator] = {}
        self.grammars = GrammarMatchers(cfg.vocab_size)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self._requests.pop(request_id, None)
            self._generators.pop(request_id, None)
            self.grammars.drop(request_id)
        states = [self._state(chunk) for chunk in out.chunks]
        if not out.chunks:
            return ModelRunnerOutput({}, {})
        # A verify step is a decode step with a few more rows: the packed product still wins there.
        is_verify_step = out.num_tokens <= MAX_PACKED_ROWS and all(
            len(c.token_ids) == 1 + len(c.draft_token_ids) and c.start_position > 0 for c in out.chunks)
        hidden, meta = self._forward(
            [(c.start_position, c.token_ids, state.block_tables) for c, state in zip(out.chunks, states)],
            [c.mm_embeds for c in out.chunks], is_verify_step,
            [state.replay_until for state in states] if self._discard_block >= 0 else (),
            [len(state.prompt_token_ids) for state in states])
        sample_rows, rows, ids, constrained, verifying = [], [], [], [], []
        end = 0
        for chunk, state in zip(out.chunks, states):
            end += len(chunk.token_ids)
            if not chunk.samples:
                continue
            drafts = chunk.draft_token_ids
            is_grammar_done = False
            if state.grammar is not None:  # never drafted for (scheduler.py)
                matcher = self.grammars.matcher(chunk.request_id, state.grammar, state.output_token_ids)
                constrained.append((len(rows), matcher))
                is_grammar_done = matcher.is_stopped()
            # A chunk with k drafts samples at its last k + 1 positions, each as a plain step
            # would after the drafts before it (speculative.py).
            for j in range(len(drafts) + 1):
                sample_rows.append(end - 1 - len(drafts) + j)
                rows.append(self._sampling_row(chunk.request_id, state, is_grammar_done, drafts[:j]))
                ids.append(chunk.request_id)
            verifying.append((chunk.request_id, drafts, rows[-1].generator))
        if not rows:
            return ModelRunnerOutput({}, {})
        # On a GPU the forward is still running: the masks are computed meanwhile.
        bitmask = self.grammars.bitmask(constrained)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)],
                                           meta.packed_products)
        rewind = {rid: g.get_state() for rid, drafts, g in verifying if drafts and g is not None}
        result = self.sampler(logits, rows, bitmask)
        if constrained:
            self.grammars.accept(ids, result.token_ids)
        return self._verify(verifying, result.token_ids, result.logprobs, rewind)

    def _state(self, chunk: ScheduledChunk) -> RequestState:
        """The request's state, brought up to date by the chunk (made anew by a first chunk)."""
        if chunk.new_request is not None:
            self._requests[chunk.request_id] = RequestState(chunk.new_request)
        state = self._requests[chunk.request_id]
        state.update(chunk)
        return state

    @staticmethod
    def _verify(verifying, token_ids: list[int], logprobs: list, rewind: dict) -> ModelRunnerOutput:
        """Each chunk's kept tokens: the sampled ones up to the first that differs from its draft.

        A seeded generator drew one uniform per sampled position; it is rewound and drawn again
        once per kept token, so the next step draws what a plain step after them would."""
        sampled, kept_logprobs = {}, {}
        at = 0
        for request_id, drafts, generator in verifying:
            num_kept = 1
            while num_kept <= len(drafts) and token_ids[at + num_kept - 1] == drafts[num_kept - 1]:
                num_kept += 1
            sampled[request_id] = token_ids[at:at + num_kept]
            kept_logprobs[request_id] = logprobs[at:at + num_kept]
            if request_id in rewind:
                generator.set_state(rewind[request_id])
                for _ in range(num_kept):
                    torch.rand(1, generator=generator, device=generator.device)
            at += len(drafts) + 1
        return ModelRunnerOutput(sampled, kept_logprobs)

    def _forward(self, chunks: list[tuple[int, list[int], Sequence[BlockTable | list[BlockId]]]],
                 mm_embeds: list[list[tuple[int, torch.Tensor]]] | None = None, is_verify_step: bool = False,
                 replay_until: Sequence[int] = (),
                 decode_from: Sequence[int] = ()) -> tuple[torch.Tensor, AttentionMetadata]:
        """Final hidden states of the flat batch, and the step's attention metadata (group 0's;
        ``chunks`` carry one block table per KV group; ``replay_until`` per chunk, where given:
        RequestState.replay_until; ``decode_from`` per chunk, where given: its request's prompt
        length, where output tokens begin (attention.build_metadata))."""
        if self.threads is not None:
            self.threads.ensure()
        input_ids = torch.tensor([t for _, toks, _ in chunks for t in toks], dtype=torch.long,
                                 device=self.device)
        inputs_embeds = None
        if mm_embeds and any(mm_embeds):
            inputs_embeds = self.model.embed_tokens(input_ids)
            row = 0
            for (_, toks, _), pieces in zip(chunks, mm_embeds):
                for offset, rows in pieces:
                    inputs_embeds[row + offset:row + offset + len(rows)] = rows.to(inputs_embeds)
                row += len(toks)
        positions = torch.cat([torch.arange(s, s + len(toks)) for s, toks, _ in chunks]).to(self.device)
        metas = [build_metadata([(s, len(toks), tables[group]) for s, toks, tables in chunks], self.block_size,
                                num_layers, self.device, self._kernels,
                                replay_until if group == 0 else (), self._discard_block, self._fresh_in_kernel,
                                decode_from)
                 for group, num_layers in enumerate(self._group_num_layers)]
        workspace = self._workspace(max(meta.max_gather_blocks for meta in metas))
        for meta in metas:
            meta.workspace, meta.is_verify_step = workspace, is_verify_step
        return self.model(input_ids, positions, self.kv_caches, metas, inputs_embeds), metas[0]

    def _workspace(self, num_blocks: int) -> torch.Tensor:
        """Scratch for gathered K/V, kept across steps and grown by doubling."""
        if self._gather_buffer.shape[1] < num_blocks:
            size = max(num_blocks, 2 * self._gather_buffer.shape[1])
            self._gather_buffer = self.kv_cache.new_empty((2, size) + tuple(self.kv_cache.shape[3:]))
        return self._gather_buffer

    def _sampling_row(self, request_id: RequestId, state: RequestState, is_grammar_done: bool = False,
                      drafts: tuple[int, ...] = ()) -> SamplingRow:
        """``drafts``: draft tokens before this position, sampled as if already output."""
        params = state.params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = self._generators.get(request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                # A request resumed here after another engine sampled its first tokens: advance
                # the stream past their draws (one per token) so the next token is the same.
                for _ in state.output_token_ids:
                    torch.rand(1, generator=generator, device=generator.device)
                self._generators[request_id] = generator
        output = [*state.output_token_ids, *drafts] if drafts else state.output_token_ids
        suppressed: tuple[int, ...] = ()
        # A complete grammar allows only EOS: it wins over min_tokens (nothing else could be sampled).
        if len(output) < params.min_tokens and not is_grammar_done:
            suppressed = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        return SamplingRow(params, state.prompt_token_ids, output, generator, suppressed)

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_tables: list[list[BlockId]], chunk_size: int | None = None,
              mm_slices=None) -> torch.Tensor:
        """Logits at every position of one sequence (oracle tests, prompt logprobs); with
        ``chunk_size``, computed in chunks of that many tokens as chunked prefill computes them
        (each chunk after the first attends to the KV the earlier ones left in the pool).
        ``mm_slices(start, num_tokens)``: the image rows to splice into a chunk (Sequence.mm_slices)."""
        chunk_size = chunk_size or len(token_ids)
        logits = []
        for start in range(0, len(token_ids), chunk_size):
            chunk = list(token_ids[start:start + chunk_size])
            hidden, _ = self._forward([(start, chunk, block_tables)],
                                      [mm_slices(start, len(chunk))] if mm_slices else None)
            logits.append(self.model.compute_logits(hidden).float())
        return torch.cat(logits)

    # ----- the disaggregation seam -------------------------------------------------------
    def block_view(self, block_id: BlockId, group: int = 0) -> torch.Tensor:
        """One block of a group's pool, KV for each of its layers, [num_layers, 2, block_size,
        kv_heads, head_dim]. A view into the pool, contiguous in memory: ``view[l, 0]`` is the
        group's layer l's K.
        """
        return self.kv_caches[group][block_id]

    @torch.inference_mode()
    def write_block(self, block_id: BlockId, data: torch.Tensor) -> None:
        self.kv_cache[block_id].copy_(data)
