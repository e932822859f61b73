"""The checkpoint's generation defaults: ``generation_config.json`` (transformers' file).

A model folder can say how it wants to be run: which ids end a turn (often more than
config.json's single ``eos_token_id``) and sampling defaults. minillm follows transformers:

    eos_token_id     generation_config.json's if it has one, else config.json's
    do_sample        false or absent: greedy; true: temperature (1.0 if absent), top_k (50 if
                     absent: transformers' default), top_p, min_p from the file
    repetition_penalty, max_new_tokens   from the file, greedy or not

A default applies only to a knob the user did not set. Fields with no minillm knob
(num_beams, max_length, ...) are listed in ``ignored``. vLLM reads the same file
(``--generation-config auto``) but does not look at do_sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import ConfigError
from .sampling import SamplingParams

FILE = "generation_config.json"
_SAMPLING_KNOBS = ("temperature", "top_k", "top_p", "min_p")  # used only when do_sample is true
_ALWAYS_KNOBS = ("repetition_penalty", "max_new_tokens")
_NOT_KNOBS = {"bos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
              "do_sample", "eos_token_id"}


@dataclass(frozen=True)
class GenerationConfig:
    """Stop ids and sampling defaults of a checkpoint, with where each came from.

    Attributes:
        eos_token_ids: ids that end generation.
        defaults: SamplingParams knob -> value, the checkpoint's defaults.
        sources: name (``eos_token_ids`` or a knob) -> where its value came from
            ("generation_config.json", "config.json", "transformers default with do_sample").
        ignored: fields of generation_config.json that minillm has no knob for.
    """

    eos_token_ids: tuple[int, ...] = ()
    defaults: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_folder(cls, folder, config_eos_token_ids=()) -> GenerationConfig:
        """Read ``folder/generation_config.json``; without it, only config.json's eos ids.

        Raises ConfigError naming the file and the field when a value is not valid.
        """
        path = Path(folder) / FILE
        if not path.is_file():
            return cls.from_model_config(config_eos_token_ids)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); fix or delete it") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, config_eos_token_ids, path)

    @classmethod
    def from_model_config(cls, config_eos_token_ids=()) -> GenerationConfig:
        """No generation_config.json: config.json's eos ids, no sampling defaults."""
        return cls(tuple(config_eos_token_ids), sources={"eos_token_ids": "config.json"})

    @classmethod
    def from_dict(cls, data: dict, config_eos_token_ids=(), path=FILE) -> GenerationConfig:
        """The rules of the module docstring applied to a parsed generation_config.json."""
        eos, eos_source = _eos_ids(data.get("eos_token_id"), path), FILE
        if eos is None:
            eos, eos_source = tuple(config_eos_token_ids), "config.json"
        if not isinstance(data.get("do_sample", False), bool):
            raise ConfigError(f"{path}: do_sample must be true or false, got {data['do_sample']!r}")
        knobs = _ALWAYS_KNOBS + (_SAMPLING_KNOBS if data.get("do_sample") else ())
        defaults = {k: data[k] for k in knobs if data.get(k) is not None}
        sources = {"eos_token_ids": eos_source, **{k: FILE for k in defaults}}
        if data.get("do_sample"):
            for knob, value in (("temperature", 1.0), ("top_k", 50)):  # transformers' defaults
                if knob not in defaults:
                    defaults[knob], sources[knob] = value, "transformers default with do_sample"
        else:
            defaults["temperature"], sources["temperature"] = 0.0, f"{FILE} (greedy)"  # do_sample absent or false
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        ignored = tuple(sorted(k for k in data if k not in _NOT_KNOBS and k not in _SAMPLING_KNOBS + _ALWAYS_KNOBS))
        return cls(eos, defaults, sources, ignored)

    def sampling_params(self, **user_set) -> SamplingParams:
        """SamplingParams of the knobs the user set (None = not set), the checkpoint's defaults
        for the others, and minillm's defaults for the rest."""
        return SamplingParams(**{**self.defaults, **{k: v for k, v in user_set.items() if v is not None}})

    def describe(self) -> list[tuple[str, object, str]]:
        """(name, value, source) for the eos ids and every sampling knob, for ``minillm info``."""
        params = self.sampling_params()
        rows = [("eos_token_ids", list(self.eos_token_ids), self.sources.get("eos_token_ids", "config.json"))]
        for f in fields(SamplingParams):
            if f.name not in ("seed", "stop", "stop_token_ids"):
                rows.append((f.name, getattr(params, f.name), self.sources.get(f.name, "minillm default")))
        return rows


def generation_config_of(model) -> GenerationConfig:
    """The model's GenerationConfig (set by :func:`~minillm.loading.load_model`), else config.json's eos ids."""
    config = getattr(model, "generation_config", None)
    return config if config is not None else GenerationConfig.from_model_config(model.config.eos_token_ids)


def _eos_ids(value, path) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)
