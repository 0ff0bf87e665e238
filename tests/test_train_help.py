"""`treespark train --help` names every data source the command reads and every loss it trains with: the lists are
taken from the code that reads and trains, so a new source, loss key, preset or drafter part without help fails
here."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import make_drafter, make_target

from hf_treespark.cli import commands as cli
from hf_treespark.training import cli as train_cli
from hf_treespark.training import data, datastore_inputs, dev_set, train_help
from hf_treespark.training.freeze import part_names
from hf_treespark.training.objective import LOSS_NAMES, LossConfig
from hf_treespark.training.trainer import PRESETS


@pytest.fixture(scope="module")
def help_text() -> str:
    """What `treespark train --help` prints."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    return out.getvalue()


def _rows(text: str) -> set[str]:
    """The first word of every indented line after the options: the names the help's tables describe."""
    after_options = text.split("\ndata it reads", 1)[-1]
    return {match.group(1) for match in re.finditer(r"^ {2,}(\S+)\s", after_options, re.MULTILINE)}


def test_every_loss_key_and_preset_has_a_line_of_its_own(help_text):
    keys = [field.name for field in dataclasses.fields(LossConfig)]
    assert set(LOSS_NAMES) <= set(keys)
    assert set(keys) <= _rows(help_text), set(keys) - _rows(help_text)
    assert set(PRESETS) <= _rows(help_text), set(PRESETS) - _rows(help_text)
    assert list(train_help.LOSSES) == keys == list(train_cli.LOSS_KEYS)  # one order everywhere


def test_every_data_source_the_readers_take_is_named(help_text):
    rows = _rows(help_text)
    mixture = set(data.SHAREGPT_MIXTURE_SOURCES) | {"hf:NAME", "PATH.jsonl"}
    assert mixture <= rows, mixture - rows
    assert all(suffix in help_text for suffix in train_cli.DATA_SUFFIXES)  # the files --data takes
    words = set(re.findall(r"[\w.:/-]+", help_text))
    fields = set(datastore_inputs.ID_FIELDS) | set(datastore_inputs.CHAT_FIELDS) | {"prompt"}  # records it reads
    assert fields <= words, fields - words
    assert str(dev_set.DEV_SET_PATH.relative_to(dev_set.DEV_SET_PATH.parents[2])) in help_text
    assert "treespark answers" in help_text and "--regenerate" in help_text and "--init-from" in help_text


def test_every_part_of_a_drafter_is_named_by_train_only(help_text):
    config = make_drafter(make_target("llama"), anchor_features=True, mask_token_id=None, depth1_head=16,
                          depth2_head=16).config
    words = set(re.findall(r"[\w.]+", " ".join(help_text.split())))
    names = {name for name in part_names(config) if not name.startswith("layers.")} | {"layers.N"}
    assert names <= words, names - words


def test_the_row_check_catches_a_loss_without_help():
    text = train_help.epilog().replace("  coverage_cap ", "  ")
    assert "coverage_cap" not in _rows(text)
