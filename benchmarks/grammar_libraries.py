"""Grammar libraries on our tokenizer: xgrammar vs llguidance, the figures the choice rests on.

SmolLM2-135M-Instruct's tokenizer (the ``tokenizers.Tokenizer`` the engine uses; masks are as
wide as the model's logits, 49,152). For each library that is installed (one that is not is
skipped): the time to build its tokenizer info, the cold compile of a non-trivial JSON schema
(nested objects, enums, arrays, required; no compile cache), the per-token mask computation
along a valid document, token by token (mean µs; the first pass over a fresh compiled grammar,
then a second pass over a new matcher of the same grammar, since llguidance builds its lexer
lazily), and correctness: every token of the document is allowed, and at its end EOS is.
Also the import time (in a fresh interpreter) and the installed size of the package itself with what it requires.
Last line: JSON, one object per library.

    .venv/bin/python benchmarks/grammar_libraries.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tokenizer import Tokenizer  # noqa: E402
from services.engine.models.loader import resolve_model_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "geo": {"type": "object", "properties": {"lat": {"type": "number"},
                                                                     "lon": {"type": "number"}},
                                   "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["city", "zip"], "additionalProperties": False},
        "history": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"year": {"type": "integer"}, "event": {"type": "string"},
                                             "kind": {"enum": ["move", "job", "other"]}},
            "required": ["year", "kind"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"],
            "address": {"city": "London", "zip": "12345", "geo": {"lat": 51.5, "lon": -0.12}},
            "history": [{"year": 1833, "event": "met Babbage", "kind": "other"}, {"year": 1843, "kind": "job"}]}


def load_tokenizer() -> tuple[Tokenizer, int]:
    path, _ = resolve_model_dir(None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return Tokenizer.from_file(path / "tokenizer.json", config), vocab


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def is_allowed(mask: np.ndarray, token_id: int) -> bool:
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def walk(fill: Callable[[], np.ndarray], accept: Callable[[int], bool], token_ids: list[int],
         eos: int) -> tuple[float, bool]:
    """Mean seconds per mask along the document, and whether the document and then EOS pass."""
    seconds, is_ok = 0.0, True
    for token_id in token_ids:
        mask, elapsed = timed(fill)
        seconds += elapsed
        is_ok = is_ok and is_allowed(mask, token_id) and accept(token_id)
    return seconds / len(token_ids), is_ok and is_allowed(fill(), eos)


def import_seconds(module: str) -> float:
    """Import time in a fresh interpreter (here torch is already loaded, which xgrammar imports)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def installed_mb(dist: str) -> float:
    """Size on disk of a distribution and, recursively, of what it requires (each counted once)."""
    seen: set[str] = set()
    todo, total = [dist], 0
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            meta = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(f.size or 0 for f in meta.files or ())
        for req in meta.requires or ():
            if "extra ==" not in req:
                todo.append(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0]
                            .split("!")[0].split("~")[0].strip())
    return round(total / 2**20, 1)


def bench_llguidance(tok: Tokenizer, vocab: int, token_ids: list[int], eos: int) -> dict:
    import llguidance as llg
    lltok, tok_s = timed(lambda: llg.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos))
    schema = json.dumps(SCHEMA)

    def compile_():
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(
            whitespace_flexible=False, item_separator=", ", key_separator=": "))
        return llg.LLMatcher(lltok, grammar)

    template, compile_s = timed(compile_)
    assert not template.is_error(), template.get_error()
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def run(matcher) -> tuple[float, bool]:
        def fill():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            return mask
        return walk(fill, matcher.consume_token, token_ids, eos)

    first_s, first_ok = run(template.deep_copy())
    second_s, second_ok = run(template.deep_copy())
    return dict(version=importlib.metadata.version("llguidance"), import_s=import_seconds("llguidance"), tokenizer_info_s=tok_s,
                compile_cold_s=compile_s, mask_us_first_pass=first_s * 1e6, mask_us=second_s * 1e6,
                correct=first_ok and second_ok, installed_mb=installed_mb("llguidance"),
                requires=importlib.metadata.distribution("llguidance").requires or [])


def bench_xgrammar(tok: Tokenizer, vocab: int, token_ids: list[int], eos: int) -> dict:
    import transformers
    import xgrammar as xgr

    def info():
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])

    tokenizer_info, tok_s = timed(info)
    compiler = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                     separators=(", ", ": ")))
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def run() -> tuple[float, bool]:
        matcher = xgr.GrammarMatcher(compiled)

        def fill():
            matcher.fill_next_token_bitmask(bitmask)
            return bitmask[0].numpy()
        return walk(fill, matcher.accept_token, token_ids, eos)

    first_s, first_ok = run()
    second_s, second_ok = run()
    return dict(version=importlib.metadata.version("xgrammar"), import_s=import_seconds("xgrammar"), tokenizer_info_s=tok_s,
                compile_cold_s=compile_s, mask_us_first_pass=first_s * 1e6, mask_us=second_s * 1e6,
                correct=first_ok and second_ok, installed_mb=installed_mb("xgrammar"),
                requires=[r for r in importlib.metadata.distribution("xgrammar").requires or ()
                          if "extra ==" not in r])


def main() -> None:
    tok, vocab = load_tokenizer()
    eos = tok.eos_token_ids[0]
    token_ids = tok.encode(json.dumps(DOCUMENT))
    print(f"document: {len(token_ids)} tokens, vocab {vocab}, EOS {eos}", file=sys.stderr)
    results = {}
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        if importlib.util.find_spec(name) is None:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        figures = bench(tok, vocab, token_ids, eos)
        results[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
        print(f"{name}: {results[name]}", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
