"""Generate a tiny random-weight model that vLLM can serve without any download.

``write_demo_model(target, kind=...)`` writes a complete Hugging Face style model folder.
``kind="llama"`` (the default) is a text model:

* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE (vocab 4096) trained
  locally on the Python standard library sources plus a short English paragraph, so any
  UTF-8 text round-trips. Special tokens: ``<unk> <s> </s> <pad> <|im_start|> <|im_end|>``.
* a ChatML chat template (``<|im_start|>role\\ncontent<|im_end|>\\n``).
* ``config.json`` / ``generation_config.json`` / ``model.safetensors``: by default a 2-layer
  Llama (hidden 256, head_dim 64) with seeded random float32 weights. Both ``</s>`` and
  ``<|im_end|>`` are end-of-generation tokens.
* ``conveyor-demo.json``: a marker written last; its presence means the folder is complete.
  It records the kind, the seed and a format version.

``kind="llava"`` and ``kind="qwen2-vl"`` are vision-language models with the same tokenizer
(plus the family's image special tokens), a tiny vision tower, an image processor and a
chat template that renders image parts as the family's unexpanded image placeholder; see
:mod:`shared.demo.vision_model`.

The output is noise (the weights are random); the point is to exercise the whole serving
stack (tokenization, chat templating, batching, streaming, stop tokens) in seconds on a CPU.

Nothing here imports vLLM; torch / tokenizers / transformers are imported lazily so that
importing this module is cheap. It lives in ``shared`` because the gateway and the workers
both generate it on first use (``conveyor/model_source.py``). About 390 lines, kept whole:
one concept (a complete, atomically installed model folder); the vision families' parts
are in :mod:`shared.demo.vision_model`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "DEFAULT_SHAPE",
    "DEMO_MODEL_NOTICE",
    "KINDS",
    "MARKER_FILE",
    "DemoShape",
    "is_demo_model",
    "write_demo_model",
]

MARKER_FILE: Final = "conveyor-demo.json"
MARKER_VERSION: Final = 1
KINDS: Final = ("llama", "llava", "qwen2-vl")

DEMO_MODEL_NOTICE: Final = (
    "Conveyor is serving its built-in demo model: a tiny Llama (or LLaVA / Qwen2-VL) with "
    "RANDOM weights and a "
    "locally trained tokenizer, so its output is noise. It exists only to exercise the "
    "serving stack (tokenization, chat template, batching, streaming, stop tokens) without "
    "downloading anything. To serve a real model, pass a local Hugging Face model folder or "
    "a hub id: `conveyor up --model /path/to/hf-folder-or-hub-id`, or "
    "`CONVEYOR_MODEL=/path/to/hf-folder-or-hub-id make run`."
)

# --- tokenizer -------------------------------------------------------------------------

UNK: Final = "<unk>"
BOS: Final = "<s>"
EOS: Final = "</s>"
PAD: Final = "<pad>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3, <|im_start|>=4, <|im_end|>=5.
SPECIAL_TOKENS: Final = (UNK, BOS, EOS, PAD, IM_START, IM_END)

VOCAB_SIZE: Final = 4096
CORPUS_MAX_CHARS: Final = 3_000_000

# ChatML. Content may be a string, None, or a list of OpenAI-style parts
# ({"type": "text", "text": ...}); non-text parts are dropped and text parts are joined
# with newlines. Whitespace control (``-``) keeps the rendered prompt exact.
CHAT_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- set ns = namespace(first=true) -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is string -%}"
    "{%- if not ns.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- part -}}{%- set ns.first = false -%}"
    "{%- elif part['type'] == 'text' -%}"
    "{%- if not ns.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- part['text'] -}}{%- set ns.first = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_ENGLISH: Final = """\
The quick brown fox jumps over the lazy dog. A serving system accepts requests from many
users at once, places them on a queue, and hands them to workers that run the model. Each
worker streams tokens back as soon as they are produced, so the first words of an answer
arrive long before the last. Hello! How are you today? I am fine, thank you. What is the
weather like in Paris, London, Tokyo, New York and Berlin? It is sunny and warm, with a
light breeze from the west. Please summarize the following text in one sentence. Sure,
here is a short summary. You are a helpful assistant. Answer the question truthfully and
concisely. The numbers are 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 1000 and 3.14159.
"""


def _corpus() -> list[str]:
    """Text that exists on every machine: the top-level stdlib sources, in sorted order."""
    texts = [_ENGLISH] * 20
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    with contextlib.suppress(OSError):
        for path in sorted(stdlib.glob("*.py")):
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if total + len(text) > CORPUS_MAX_CHARS:
                break
            texts.append(text)
            total += len(text)
    return texts


def _train_tokenizer() -> Any:
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[
            AddedToken(t, special=True, normalized=False, single_word=False) for t in SPECIAL_TOKENS
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encode(text, add_special_tokens=True) prepends <s>.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tok


# --- model -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoShape:
    """The text model's size. Keep ``hidden_size / num_heads >= 64``: vLLM's CPU
    attention needs head_dim >= 64."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 2048


DEFAULT_SHAPE: Final = DemoShape()
# Large init std makes the logits peaked (std ~ sqrt(hidden) * 0.2 ~ 3), so greedy decoding
# is not decided by float near-ties and is stable across kernels / batch shapes.
INIT_STD: Final = 0.2


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _write_model(
    out: Path,
    *,
    seed: int,
    shape: DemoShape,
    vocab_size: int,
    bos_id: int,
    eos_ids: list[int],
    pad_id: int,
) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    # transformers >= 4.56 calls it `dtype` (and warns about `torch_dtype`); older: `torch_dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "architectures": ["LlamaForCausalLM"],
        dtype_key: "float32",
    }
    config = LlamaConfig(**kwargs)  # rope: the default (theta 10000) in every release
    config.save_pretrained(out)

    generation = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    generation.save_pretrained(out)

    # The state dict is built directly (not through LlamaForCausalLM's initializer, whose
    # details change between transformers releases) so a seed always gives the same bytes.
    gen = torch.Generator().manual_seed(seed)
    h, i, v = shape.hidden_size, shape.intermediate_size, vocab_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h)}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = normal(h, h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        tensors[p + "mlp.gate_proj.weight"] = normal(i, h)
        tensors[p + "mlp.up_proj.weight"] = normal(i, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, i)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(v, h)
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors creates it 0600


# --- public API --------------------------------------------------------------------------


def _marker(seed: int, kind: str, shape: DemoShape) -> dict[str, Any]:
    marker: dict[str, Any] = {"kind": kind, "version": MARKER_VERSION, "seed": seed}
    if shape != DEFAULT_SHAPE:  # the default's marker stays as it was: no regeneration
        marker["shape"] = asdict(shape)
    return marker


def _read_marker(target: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((target / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_demo_model(path: Path | str, kind: str | None = None) -> bool:
    """True if ``path`` is a complete folder written by :func:`write_demo_model` (of
    ``kind``, when given)."""
    marker = _read_marker(Path(path))
    if marker is None or marker.get("kind") not in KINDS:
        return False
    return kind is None or marker.get("kind") == kind


def _is_current(target: Path, seed: int, kind: str, shape: DemoShape) -> bool:
    return _read_marker(target) == _marker(seed, kind, shape)


def write_demo_model(
    target: Path, *, seed: int = 0, kind: str = "llama", shape: DemoShape = DEFAULT_SHAPE
) -> Path:
    """Generate (idempotently) a tiny random model + tokenizer + chat template at `target`.

    ``kind`` is one of :data:`KINDS`: ``"llama"`` (text), ``"llava"`` or ``"qwen2-vl"``
    (vision-language). Returns ``target``. If ``target`` already holds a complete demo
    model of this kind and ``seed`` (marker file present), returns immediately. Everything
    is written into a temporary sibling directory that is renamed onto ``target`` at the
    end, so a crash never leaves a half-written model. An existing demo model of another
    kind/seed/version is replaced; a non-empty directory that is not a demo model raises
    ``FileExistsError``. ``shape`` sizes the text model (``kind="llama"`` only; benchmarks
    that need a slower prefill use a larger one).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown demo model kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind != "llama" and shape != DEFAULT_SHAPE:
        raise ValueError("a demo model shape applies to kind 'llama' only")
    target = Path(target)
    if _is_current(target, seed, kind, shape):
        return target
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not is_demo_model(target):
        raise FileExistsError(f"{target} is not empty and is not a Conveyor demo model")

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_all(tmp, seed=seed, kind=kind, shape=shape)
        _install(tmp, target, seed, kind, shape)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_all(out: Path, *, seed: int, kind: str, shape: DemoShape) -> None:
    from transformers import PreTrainedTokenizerFast

    from shared.demo.vision_model import TokenIds, chat_template, vision_spec

    tok = _train_tokenizer()
    spec = vision_spec(kind) if kind != "llama" else None
    extra = list(spec.special_tokens) if spec is not None else []
    if extra:  # appended after the trained vocabulary: text tokenizes as for "llama"
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    ids = {t: int(tok.token_to_id(t)) for t in (*SPECIAL_TOKENS, *extra)}
    vocab_size = _round_up(int(tok.get_vocab_size(with_added_tokens=True)), 64)
    template = CHAT_TEMPLATE if spec is None else chat_template(spec.placeholder)
    additional = [IM_START, IM_END, *extra]

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=additional,
        clean_up_tokenization_spaces=False,
        model_max_length=shape.max_positions,
        padding_side="left",
    )
    fast.chat_template = template
    eos_ids = [ids[EOS], ids[IM_END]]
    if spec is None:
        fast.save_pretrained(out)
        _write_model(
            out,
            seed=seed,
            shape=shape,
            vocab_size=vocab_size,
            bos_id=ids[BOS],
            eos_ids=eos_ids,
            pad_id=ids[PAD],
        )
    else:
        from shared.demo.vision_model import write_vision_model

        token_ids = TokenIds(
            vocab_size=vocab_size,
            bos=ids[BOS],
            eos=eos_ids,
            pad=ids[PAD],
            special={t: ids[t] for t in extra},
        )
        write_vision_model(out, kind=kind, seed=seed, tokenizer=fast, ids=token_ids)
    _normalize_tokenizer_config(out / "tokenizer_config.json", additional, template)
    # Written last: its presence means the folder is complete.
    marker = _marker(seed, kind, shape)
    (out / MARKER_FILE).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def _normalize_tokenizer_config(path: Path, additional: list[str], template: str) -> None:
    """Make ``tokenizer_config.json`` loadable by transformers 4.x as well as 5.x.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and a list-valued
    ``extra_special_tokens`` (a dict in 4.x), and keeps the chat template only in
    ``chat_template.jinja`` (which 4.x releases before ~4.50 do not read). 5.x still reads
    the 4.x spellings, so write those.
    """
    cfg: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = additional
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _install(tmp: Path, target: Path, seed: int, kind: str, shape: DemoShape) -> None:
    """Atomically move the finished folder ``tmp`` to ``target``."""
    old: Path | None = None
    if target.is_dir() and any(target.iterdir()):
        if _is_current(target, seed, kind, shape):  # a concurrent writer finished first
            return
        # An outdated demo model: move it aside, then swap the new one in.
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "model")
    try:
        os.replace(tmp, target)  # atomic; also succeeds onto an empty directory
    except OSError:
        if not _is_current(target, seed, kind, shape):  # lost a race to another writer?
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
