"""Unit-test fixtures: a tiny real tokenizer (BPE trained on a few sentences) and model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway.model_catalog import ServedModel
from gateway.tokenizer import ModelTokenizer

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


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tokenizer_folder: Path) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_folder)


@pytest.fixture(scope="session")
def served_model(tokenizer_folder: Path, tiny_tokenizer: ModelTokenizer) -> ServedModel:
    return ServedModel(
        name="tiny",
        path=str(tokenizer_folder),
        tokenizer=tiny_tokenizer,
        max_model_len=MAX_MODEL_LEN,
        created_unix=1_700_000_000,
    )
