"""``data.apply_chat_template_kwargs``: further arguments of the chat template wherever rlx renders a conversation
(the training and validation prompts, the turns of multi-turn episodes), and the arguments rlx sets itself refused
as config errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_trainer_surface import make_trainer

from rlx.agent import AgentLimits, EpisodeRunner, render_after_turn
from rlx.config import validate
from rlx.errors import ConfigError
from rlx.run.data import load_prompts

# The tiny model's template, its assistant header naming the template variable reasoning_effort.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant effort={{ reasoning_effort | default('none') }}\n"
            "{% endif %}")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tiny model runs on one thread."""


@pytest.fixture
def model(tiny_model_path, tmp_path) -> Path:
    folder = Path(shutil.copytree(tiny_model_path, tmp_path / "model"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture
def tokenizer(model):
    from rlx.run.models import load_tokenizer

    return load_tokenizer(str(model), False)


@pytest.fixture
def prompts(tmp_path) -> str:
    import pandas as pd

    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "1+1"}], [{"role": "user", "content": "2+2"}]],
                  "data_source": ["arith", "arith"],
                  "reward_model": [{"ground_truth": "2"}, {"ground_truth": "4"}]}).to_parquet(path)
    return str(path)


def test_prompts_are_rendered_with_the_arguments(tokenizer, prompts):
    def texts(**kwargs):
        data = load_prompts([prompts], tokenizer, prompt_key="prompt", max_prompt_length=256, filter_overlong=True,
                            source_key="data.train_files", **kwargs)
        return [e.text for e in data.examples], [e.input_ids for e in data.examples]

    (plain, plain_ids), (medium, medium_ids) = texts(), texts(template_kwargs={"reasoning_effort": "medium"})
    assert plain[0].endswith("<|im_start|>assistant effort=none\n")
    assert medium[0].endswith("<|im_start|>assistant effort=medium\n") and medium_ids[0] != plain_ids[0]
    assert medium_ids[0] == tokenizer(medium[0], add_special_tokens=False)["input_ids"]


def test_episode_turns_are_rendered_with_the_arguments(tokenizer):
    turn = [{"role": "tool", "content": "4"}]
    plain = tokenizer.decode(render_after_turn(tokenizer, turn, None))
    medium = tokenizer.decode(render_after_turn(tokenizer, turn, None, {"reasoning_effort": "high"}))
    assert plain.endswith("assistant effort=none\n") and medium.endswith("assistant effort=high\n")
    runner = EpisodeRunner(None, {}, tokenizer, AgentLimits(), lambda prompts, params: prompts,
                           template_kwargs={"reasoning_effort": "high"})
    assert tokenizer.decode(runner.render_turns(turn)) == medium


def test_the_trainer_renders_training_and_validation_prompts_with_them(model, tmp_path):
    from rlx.plugins.tasks import builtin

    val = builtin.resolve("builtin:arith-test")
    trainer = make_trainer(tmp_path / "run", f"model.path={model}", f"data.val_files=[{val}]",
                           "data.apply_chat_template_kwargs.reasoning_effort=medium")
    assert trainer.train_set.examples[0].text.endswith("assistant effort=medium\n")
    assert trainer.val_set is not None and trainer.val_set.examples[0].text.endswith("assistant effort=medium\n")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokenize": True}, "data.apply_chat_template_kwargs: tokenize is set by rlx"),
    ({"add_generation_prompt": False}, "add_generation_prompt is set by rlx"),
    ({"tools": []}, "tools is set by rlx"),
    ({"reasoning-effort": "low"}, "the key 'reasoning-effort' is not a template variable name"),
])
def test_arguments_rlx_sets_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        validate({"data": {"apply_chat_template_kwargs": kwargs}})
    assert message in str(info.value)
    assert validate({"data": {"apply_chat_template_kwargs": {"enable_thinking": False}}}
                    ).data.apply_chat_template_kwargs == {"enable_thinking": False}
