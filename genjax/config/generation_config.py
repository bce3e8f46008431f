"""``GenerationConfig``: the fields of :mod:`genjax.config.fields` with validation, the pytree
split and transformers' JSON files; :mod:`genjax.config` documents the design."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from genjax.config import checks, pytree
from genjax.config import files as io
from genjax.config.fields import (
    DEFAULT_GENERATION_PARAMS,
    FIELD_NAMES,
    METADATA_FIELDS,
    NEUTRAL_VALUES,
    TRACED_FIELDS,
    TRANSFORMERS_VERSION,
    GenerationFields,
    GenerationMode,
)
from genjax.config.files import FrozenDict
from genjax.errors import GenerationConfigError


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class GenerationConfig(GenerationFields):
    """Generation settings with transformers v5's fields, defaults and JSON format.

    Field meanings are transformers' (see its ``GenerationConfig`` docs). Each comment below gives
    static (S) or traced (T), the type, and the allowed values; ``None`` means "use the default"
    (``DEFAULT_GENERATION_PARAMS``, applied by ``with_defaults()``). Unknown keys read from a file
    live in ``extra`` and are readable as attributes.

    Example:
        >>> cfg = GenerationConfig(max_new_tokens=64, do_sample=True, temperature=0.7, top_p=0.9)
        >>> cfg.generation_mode
        <GenerationMode.SAMPLE: 'sample'>
        >>> cfg.replace(temperature=0.8).temperature
        0.8
    """

    def __post_init__(self, _user_set: frozenset[str] | None) -> None:
        for name in FIELD_NAMES:
            value = getattr(self, name)
            normalized = checks.normalize(name, value)
            if normalized is not value:
                object.__setattr__(self, name, normalized)
            checks.check_field(name, normalized)
        object.__setattr__(self, "extra", _normalize_extra(self.extra))
        checks.check_combinations(self)
        if _user_set is None:
            _user_set = frozenset(n for n in FIELD_NAMES if getattr(self, n) is not None)
        issues = checks.minor_issues(self, _user_set)
        if issues:
            checks.warn_minor(issues)
        if (
            self.continuous_batching_config is not None
            and "continuous_batching_config" in _user_set
        ):
            warnings.warn(
                "continuous_batching_config is deprecated in transformers and unused by genjax.",
                FutureWarning,
                stacklevel=3,
            )

    # --- derived values ---

    def is_active(self, name: str) -> bool:
        """Whether traced field ``name`` is a pytree leaf (set and not at its neutral value).

        Arrays and tracers are always active. ``genjax.generate`` enables a processor exactly when
        its field is active, so the choice is static while the strength is traced.

        Args:
            name: one of ``TRACED_FIELDS``.

        Example:
            >>> GenerationConfig(temperature=1.0).is_active("temperature")
            False
            >>> GenerationConfig(do_sample=True, temperature=0.7).is_active("temperature")
            True
        """
        if name not in TRACED_FIELDS:
            raise ValueError(
                f"is_active({name!r}): only traced fields have an active state, and {name!r} is "
                f"static; read config.{name} directly. Traced fields: {', '.join(TRACED_FIELDS)}."
            )
        value = getattr(self, name)
        if value is None:
            return False
        if io.is_array(value) or io.is_tracer(value) or name not in NEUTRAL_VALUES:
            return True
        return value != NEUTRAL_VALUES[name]

    def with_defaults(self) -> GenerationConfig:
        """A config whose ``None`` fields are filled from ``DEFAULT_GENERATION_PARAMS``.

        This is what v5's ``generate`` does before running; ``genjax.generate`` calls it too. Set
        fields (including ``extra`` and metadata) are kept. Works on traced configs.

        Example:
            >>> cfg = GenerationConfig(max_new_tokens=8).with_defaults()
            >>> cfg.num_beams, cfg.top_k, cfg.max_new_tokens
            (1, 50, 8)
        """
        fills = {
            key: value
            for key, value in DEFAULT_GENERATION_PARAMS.items()
            if value is not None and getattr(self, key) is None
        }
        if not fills:
            return self
        return dataclasses.replace(self, **fills, _user_set=frozenset(fills))

    @property
    def generation_mode(self) -> GenerationMode:
        """The decoding strategy (``get_generation_mode()`` without an assistant model).

        Example:
            >>> GenerationConfig(num_beams=4).generation_mode
            <GenerationMode.BEAM_SEARCH: 'beam_search'>
        """
        return self.get_generation_mode()

    def get_generation_mode(self, assistant_model: Any = None) -> GenerationMode:
        """The decoding strategy, by v5's rules applied to the config with defaults filled in.

        Args:
            assistant_model: a draft model; when given, greedy and sampling become assisted
                generation.

        Example:
            >>> GenerationConfig(do_sample=True, num_beams=2).get_generation_mode()
            <GenerationMode.BEAM_SAMPLE: 'beam_sample'>
        """
        get = self._resolved
        if get("constraints") is not None or get("force_words_ids") is not None:
            mode = GenerationMode.CONSTRAINED_BEAM_SEARCH
        elif get("num_beams") == 1:
            if get("do_sample") is not True:
                contrastive = (get("penalty_alpha") or 0) > 0 and _exceeds(get("top_k"), 1)
                mode = (
                    GenerationMode.CONTRASTIVE_SEARCH
                    if contrastive
                    else GenerationMode.GREEDY_SEARCH
                )
            else:
                mode = GenerationMode.SAMPLE
        elif get("num_beam_groups") > 1:
            mode = GenerationMode.GROUP_BEAM_SEARCH
        else:
            mode = (
                GenerationMode.BEAM_SAMPLE
                if get("do_sample") is True
                else GenerationMode.BEAM_SEARCH
            )
        basic = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
        assisted = (
            assistant_model is not None
            or get("use_mtp")
            or get("prompt_lookup_num_tokens") is not None
            or get("assistant_early_exit") is not None
        )
        for trigger, new_mode in (
            (assisted, GenerationMode.ASSISTED_GENERATION),
            (get("dola_layers") is not None, GenerationMode.DOLA_GENERATION),
        ):
            if not trigger:
                continue
            if mode in basic:
                mode = new_mode
            else:
                warnings.warn(
                    f"{new_mode.value} only extends greedy search and sampling, but the flags "
                    f"select {mode.value}; the {new_mode.value} flags will be ignored.",
                    UserWarning,
                    stacklevel=2,
                )
        return mode

    def _resolved(self, name: str) -> Any:
        value = getattr(self, name)
        return DEFAULT_GENERATION_PARAMS.get(name) if value is None else value

    # --- copies, checks ---

    def replace(self, **changes: Any) -> GenerationConfig:
        """A new config with ``changes`` applied and validated.

        Args:
            **changes: field names and values; ``extra=`` replaces the whole ``extra`` mapping.

        Raises:
            TypeError: for a name that is not a field (to store a custom key, use
                ``updated(..., allow_custom_entries=True)``).
            GenerationConfigError: for a bad value.

        Example:
            >>> GenerationConfig().replace(max_new_tokens=16).max_new_tokens
            16
        """
        unknown = [key for key in changes if key not in _FIELD_SET and key != "extra"]
        if unknown:
            raise TypeError(checks.unknown_field_message(unknown[0]))
        return dataclasses.replace(self, **changes, _user_set=frozenset(changes))

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Raises TypeError: v5 updates in place, but a config is an immutable pytree. Use
        :meth:`replace` for a new config, or :meth:`updated` for ``(new_config, unused)``."""
        raise TypeError(checks.immutable_update_message(args, kwargs))

    def updated(
        self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]:
        """v5's ``update`` without mutation: returns ``(new_config, unused_kwargs)``.

        Args:
            defaults_only: only set fields that are currently ``None``.
            allow_custom_entries: store unknown keys in ``extra`` instead of returning them.
            **kwargs: values to set. Unknown keys (not fields, not already in ``extra``) are
                returned unused.

        Example:
            >>> cfg, unused = GenerationConfig().updated(max_new_tokens=10, foo=1)
            >>> cfg.max_new_tokens, unused
            (10, {'foo': 1})
        """
        changes: dict[str, Any] = {}
        extra = dict(self.extra)
        unused: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in _FIELD_SET:
                current, target = getattr(self, key), changes
            elif key in extra:
                current, target = extra[key], extra
            elif allow_custom_entries:
                current, target = None, extra
            else:
                unused[key] = value
                continue
            if defaults_only and current is not None:
                unused[key] = value
            else:
                target[key] = value
        used = frozenset(kwargs) - frozenset(unused)
        config = dataclasses.replace(self, **changes, extra=extra, _user_set=used)
        return config, unused

    def validate(self, strict: bool = False, user_set_attributes: Any = None) -> None:
        """Checks every field and combination, as v5's ``validate`` does, and more strictly.

        Bad values raise ``GenerationConfigError`` naming the field, the value, the allowed range
        and a fix (construction already runs these checks). Combinations that v5 only warns about
        (e.g. ``temperature`` set while ``do_sample`` is not True) emit a ``UserWarning``, or raise
        when ``strict``. Tracers are skipped.

        Args:
            strict: raise instead of warning.
            user_set_attributes: names the caller set explicitly; warnings about a flag fire only
                if it was set (v5's rule). ``None`` counts every field as set.

        Example:
            >>> GenerationConfig(do_sample=True, top_p=0.9).validate(strict=True)
        """
        for name in FIELD_NAMES:
            checks.check_field(name, getattr(self, name))
        checks.check_combinations(self)
        user_set = None if user_set_attributes is None else frozenset(user_set_attributes)
        issues = checks.minor_issues(self, user_set)
        if issues and strict:
            lines = "\n".join(f"- {name}: {text}" for name, text in issues.items())
            raise GenerationConfigError(f"GenerationConfig is invalid:\n{lines}")
        if issues:
            checks.warn_minor(issues)

    # --- equality, hashing, access ---

    def _content(self) -> tuple[Any, ...]:
        values = tuple(io.canonical(getattr(self, name)) for name in _COMPARED_FIELDS)
        return (*values, io.canonical(self.extra))

    def __eq__(self, other: object) -> bool:
        """Equal when all non-metadata fields and ``extra`` are equal (arrays by value)."""
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return self._content() == other._content()

    def __hash__(self) -> int:
        """Hash of the content; raises ``TypeError`` when a field holds a tracer."""
        return hash(self._content())

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            extra = self.__dict__.get("extra")
            if extra is not None and name in extra:
                return extra[name]
        raise AttributeError(f"'GenerationConfig' object has no attribute {name!r}")

    def __repr__(self) -> str:
        parts = [
            f"{name}={getattr(self, name)!r}"
            for name in FIELD_NAMES
            if getattr(self, name) is not None
        ]
        if self.extra:
            parts.append(f"extra={dict(self.extra)!r}")
        return f"GenerationConfig({', '.join(parts)})"

    # --- serialization ---

    def to_dict(self) -> dict[str, Any]:
        """All fields, ``transformers_version`` and ``extra`` keys as plain JSON types (v5's form).

        Lists come back as lists (``bad_words_ids``, ``eos_token_id``), ``sequence_bias`` as a list
        of ``[token_ids, bias]`` pairs, arrays via ``tolist()``.

        Example:
            >>> GenerationConfig(eos_token_id=[1, 2]).to_dict()["eos_token_id"]
            [1, 2]
        """
        return _to_plain_dict(self)

    def to_diff_dict(self) -> dict[str, Any]:
        """``to_dict()`` without the values equal to ``GenerationConfig()``'s (v5's rule).

        ``transformers_version`` and ``extra`` keys are always kept.

        Example:
            >>> GenerationConfig(max_new_tokens=5).to_diff_dict() == {
            ...     "max_new_tokens": 5, "transformers_version": TRANSFORMERS_VERSION}
            True
        """
        default = _default_dict()
        return {
            key: value
            for key, value in self.to_dict().items()
            if key not in default or key == "transformers_version" or value != default[key]
        }

    def to_json_string(
        self,
        use_diff: bool = True,
        ignore_metadata: bool = False,
        keys_to_pop: list[str] | None = None,
    ) -> str:
        """JSON text as transformers writes it: sorted keys, indent 2, trailing newline.

        Args:
            use_diff: only the values that differ from ``GenerationConfig()``.
            ignore_metadata: drop ``_from_model_config`` and ``transformers_version``.
            keys_to_pop: keys to drop before writing.

        Example:
            >>> text = GenerationConfig(max_new_tokens=5).to_json_string(ignore_metadata=True)
            >>> print(text, end="")
            {
              "max_new_tokens": 5
            }
        """
        config_dict = self.to_diff_dict() if use_diff else self.to_dict()
        for key in (*(keys_to_pop or ()), *(METADATA_FIELDS if ignore_metadata else ())):
            config_dict.pop(key, None)
        return io.dumps(config_dict)

    def to_json_file(
        self,
        json_file_path: str | os.PathLike,
        use_diff: bool = True,
        keys_to_pop: list[str] | None = None,
    ) -> None:
        """Writes ``to_json_string()`` atomically: a failure leaves any existing file untouched.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "generation_config.json")
            >>> GenerationConfig(max_new_tokens=5).to_json_file(path)
        """
        text = self.to_json_string(use_diff=use_diff, keys_to_pop=keys_to_pop)
        io.write_text_atomic(json_file_path, text)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        config_file_name: str = "generation_config.json",
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """Saves ``save_directory/config_file_name`` (diff form, without ``compile_config``).

        As in v5, a config that is not exactly as loaded by ``from_pretrained`` is validated
        strictly first, so a config that would warn is refused rather than saved.

        Args:
            save_directory: created if missing.
            config_file_name: the file name.
            push_to_hub: also upload the file with ``huggingface_hub`` (imported lazily).
            **kwargs: Hub options: ``repo_id`` (default: the directory name), ``token``,
                ``private``, ``commit_message``, ``revision``, ``create_pr``.

        Example:
            >>> import tempfile
            >>> GenerationConfig(max_new_tokens=8).save_pretrained(tempfile.mkdtemp())
        """
        try:
            self.validate(strict=not self.__dict__.get("_loaded_unmodified", False))
        except GenerationConfigError as err:
            raise GenerationConfigError(
                f"{err}\n\nFix these issues to save the configuration."
            ) from err
        if os.path.isfile(save_directory):
            raise NotADirectoryError(
                f"save_pretrained needs a directory, but {os.fspath(save_directory)!r} is a file."
            )
        if kwargs and not push_to_hub:
            raise TypeError(f"save_pretrained got unexpected arguments: {sorted(kwargs)}.")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, config_file_name)
        self.to_json_file(path, use_diff=True, keys_to_pop=["compile_config"])
        if push_to_hub:
            io.upload_to_hub(path, config_file_name, save_directory, kwargs)

    # --- loading ---

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], **kwargs: Any) -> Any:
        """Builds a config from a dict such as a parsed ``generation_config.json``.

        Unknown keys of ``config_dict`` go to ``extra``. ``kwargs`` override it; an unknown kwarg
        also goes to ``extra`` (as in v5), unless ``return_unused_kwargs=True``, in which case it
        is returned instead. When ``_from_model_config`` is true, unknown keys are dropped (v5).

        Returns:
            The config, or ``(config, unused_kwargs)`` when ``return_unused_kwargs=True``.

        Example:
            >>> GenerationConfig.from_dict({"max_length": 5, "my_key": 1}).my_key
            1
        """
        return_unused = kwargs.pop("return_unused_kwargs", False)
        kwargs.pop("_from_auto", None)
        kwargs.pop("_from_pipeline", None)
        known, extra, unused = io.split_config_dict(config_dict, kwargs, _FIELD_SET, return_unused)
        config = cls(**known, extra=extra)
        return (config, unused) if return_unused else config

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> GenerationConfig:
        """Reads a ``generation_config.json`` file.

        Raises:
            GenerationConfigError: for malformed JSON (naming the file, line and column) or bad
                values.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "generation_config.json")
            >>> GenerationConfig(max_new_tokens=5).to_json_file(path)
            >>> GenerationConfig.from_json_file(path).max_new_tokens
            5
        """
        return cls.from_dict(io.read_json_file(json_file))

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name: str | os.PathLike,
        config_file_name: str = "generation_config.json",
        cache_dir: str | os.PathLike | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        revision: str = "main",
        subfolder: str = "",
        return_unused_kwargs: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Loads a generation config from a local directory, a file path, or a Hub repo id.

        Args:
            pretrained_model_name: directory holding ``config_file_name``, a path to the file
                itself, or a Hub repo id (downloaded with ``huggingface_hub.hf_hub_download``).
            config_file_name: the file name inside the directory or repo.
            cache_dir, force_download, local_files_only, token, revision, subfolder: passed to
                ``hf_hub_download`` (``subfolder`` also applies to a local directory).
            return_unused_kwargs: also return the kwargs that are not fields (see ``from_dict``).
            **kwargs: values that override the loaded ones.

        Returns:
            The config, or ``(config, unused_kwargs)``.

        Example:
            >>> import tempfile
            >>> folder = tempfile.mkdtemp()
            >>> GenerationConfig(max_new_tokens=8).save_pretrained(folder)
            >>> cfg = GenerationConfig.from_pretrained(folder, max_length=30)
            >>> cfg.max_new_tokens, cfg.max_length
            (8, 30)
        """
        kwargs.pop("proxies", None)
        path = io.resolve_config_file(
            pretrained_model_name,
            config_file_name,
            subfolder=subfolder,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
            revision=revision,
        )
        config_dict = io.read_json_file(path)
        if kwargs.pop("_from_model_config", False):
            return cls.from_model_config(config_dict)
        result = cls.from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)
        config = result[0] if return_unused_kwargs else result
        object.__setattr__(config, "_loaded_unmodified", True)
        return result

    @classmethod
    def from_model_config(cls, model_config: Any) -> GenerationConfig:
        """Builds a config from a model's ``config.json`` (dict, path, or object with ``to_dict``).

        As in v5: generation fields and token ids are picked up (``None`` values ignored), other
        keys dropped, unset fields filled from a ``decoder``/``generator``/``text_config``
        sub-config, ``return_dict_in_generate`` set when an ``output_*`` flag is true, and
        ``_from_model_config`` marked.

        Example:
            >>> cfg = GenerationConfig.from_model_config({"eos_token_id": 2, "vocab_size": 10})
            >>> cfg.eos_token_id, cfg._from_model_config
            (2, True)
        """
        model_config = io.read_model_config(model_config)
        config_dict = {
            key: value
            for key, value in model_config.items()
            if value is not None and key != "_from_model_config"
        }
        config = cls.from_dict(config_dict, _from_model_config=True)
        sub = io.decoder_config(model_config)
        fills = {n: sub[n] for n in FIELD_NAMES if n in sub and getattr(config, n) is None}
        if not config.return_dict_in_generate:
            flags = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")
            if any(fills.get(flag, getattr(config, flag)) for flag in flags):
                fills["return_dict_in_generate"] = True
        if fills:
            config = dataclasses.replace(config, **fills, _user_set=frozenset(fills))
        object.__setattr__(config, "_loaded_unmodified", True)
        return config


_FIELD_SET = frozenset(FIELD_NAMES)
_COMPARED_FIELDS = tuple(n for n in FIELD_NAMES if n not in METADATA_FIELDS)
assert set(checks.SPECS) == _FIELD_SET, "every field needs a validation spec"


def _exceeds(value: Any, bound: int) -> bool:
    """``value > bound`` for scalars, concrete arrays (all rows) and tracers (assumed true)."""
    if io.is_tracer(value):
        return True
    return bool(np.all(np.asarray(value) > bound))


def _normalize_extra(extra: Any) -> FrozenDict:
    if not isinstance(extra, Mapping):
        raise GenerationConfigError(
            f"GenerationConfig.extra must be a mapping of custom keys to values; got {extra!r}."
        )
    clashes = [key for key in extra if key in _FIELD_SET]
    if clashes:
        raise GenerationConfigError(
            f"GenerationConfig.extra holds {clashes[0]!r}, which is a field; pass it as "
            f"{clashes[0]}=... instead."
        )
    return io.freeze({k: v for k, v in extra.items() if k not in io.DROPPED_KEYS})


def _to_plain_dict(config: GenerationConfig) -> dict[str, Any]:
    out = {name: io.thaw(getattr(config, name)) for name in FIELD_NAMES}
    out["transformers_version"] = config.transformers_version or TRANSFORMERS_VERSION
    out.update(io.thaw(config.extra))
    return out


@functools.cache
def _default_dict() -> dict[str, Any]:
    return GenerationConfig().to_dict()


pytree.register(GenerationConfig)
