"""A tiny real tokenizer (BPE trained on a few sentences) and a served model around it.

The fixtures built from these (``tokenizer_folder``, ``tiny_tokenizer``, ``served_model``)
are in tests/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import ModelTokenizer
from gateway.openai.output_formats import detect

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Conveyor streams tokens from workers to clients.",
    "A gateway queues jobs in Redis streams and workers run them on vLLM.",
    "user assistant system: say hello, then stop.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ?",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a conversation cannot start with a tool message') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MAX_MODEL_LEN = 64


def build_tokenizer_folder(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_served_model(folder: Path, tokenizer: ModelTokenizer) -> ServedModel:
    return ServedModel(
        name="tiny",
        path=str(folder),
        tokenizer=tokenizer,
        max_model_len=MAX_MODEL_LEN,
        created_unix=1_700_000_000,
        output_formats=detect(tokenizer.template_source, "auto", "auto"),
    )


VISION_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}assistant:"
)


def build_vision_model(folder: Path, *, name: str = "tiny-vl") -> ServedModel:
    """A vision-language model's tokenizer: ``<image>`` is its (unexpanded) image token."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<image>")],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["describe this picture please", "user assistant"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": VISION_TEMPLATE}))
    image_token = tokenizer.token_to_id("<image>")
    assert image_token is not None
    return ServedModel(
        name=name,
        path=str(folder),
        tokenizer=ModelTokenizer(folder),
        max_model_len=512,
        created_unix=0,
        image_token_id=image_token,
    )
