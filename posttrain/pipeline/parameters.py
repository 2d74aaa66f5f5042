"""A flow's parameters: every field of its settings model as one flat, typed, top-level parameter.

Prefect merges a run's parameters with its deployment's at the top level only, so a nested
``settings`` object would make a user copy every field to change one. Here the flows take the
settings' own fields plus the fields of each group (``publish``, ``trainer``, ``rollout``, ``lora``, ``gc``) as
top-level parameters: ``--param learning_rate=5e-5`` changes exactly that, and the deployment's
defaults hold for the rest. The schema carries each field's type, bounds, pattern and
description, so a deployment with ``enforce_parameter_schema`` refuses a bad value when the run
is created, and the UI form shows one input per field.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from posttrain.pipeline.settings import BLOCK_PARAMETERS, PROMOTION_BLOCK_PARAMETERS

#: Settings fields whose model's fields become top-level parameters.
GROUPS = ("publish", "trainer", "rollout", "lora", "promotion", "gc")


class ParameterError(ValueError):
    """Flow parameters that do not make valid settings; the message names each parameter at fault."""


def _groups(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in model.model_fields.items() if name in GROUPS}


def parameter_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The flat parameters of a settings model: its own fields, each group replaced by the group's fields."""
    fields: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        inner = field.annotation.model_fields if name in GROUPS else {name: field}
        for key, info in inner.items():
            if key in fields:
                raise TypeError(f"{model.__name__}: parameter {key!r} appears twice (group {name!r})")
            fields[key] = info
    return fields


def from_parameters(model: type[BaseModel], params: dict[str, Any]):
    """Settings from flat parameters; errors name the parameters (``learning_rate``, not ``trainer.learning_rate``)."""
    groups = _groups(model)
    unknown = sorted(set(params) - set(parameter_fields(model)))
    if unknown:
        raise ParameterError(f"unknown parameters: {', '.join(unknown)}")
    values: dict[str, Any] = {k: v for k, v in params.items() if k in model.model_fields and k not in groups}
    for group, group_model in groups.items():
        values[group] = {k: v for k, v in params.items() if k in group_model.model_fields}
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ParameterError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in GROUPS:
        loc = loc[1:]
    msg = err["msg"].removeprefix("Value error, ")
    # A group's own validator already names the parameters in its message.
    return f"{'.'.join(loc)}: {msg}" if loc else msg


def to_parameters(settings: BaseModel) -> dict[str, Any]:
    """The flat parameters of ``settings`` (JSON-compatible): what ``from_parameters`` turns back into them."""
    out: dict[str, Any] = {}
    for name, value in settings.model_dump(mode="json").items():
        out.update(value if name in GROUPS else {name: value})
    return out


def _block_annotation(field: FieldInfo, constraints: FieldInfo, blocks: tuple[type, ...]) -> Any:
    """A block parameter: its ``<slug>/<name>`` (the CLI's and the deployments' values), a saved block of
    one of ``blocks`` (the UI form's picker sends a reference to it), or null where the setting allows none.

    Flat ``anyOf`` members, the name first and titled: the UI's run form shows a tab per member (labelled
    by its title, else its type) and opens the first one whose JSON ``type`` is the value's. A nested
    ``anyOf`` (``str | None``) has no ``type``, so the form opened the block picker instead, empty, for a
    value that names a block."""
    named = copy.copy(constraints)
    named.title = "by name"
    optional = type(None) in get_args(field.annotation)
    return Union[(Annotated[str, named], *blocks, *((type(None),) if optional else ()))]  # noqa: UP007


def _parameter(name: str, field: FieldInfo) -> inspect.Parameter:
    constraints = copy.copy(field)  # bounds, pattern, schema extras; the default goes on the parameter
    constraints.default, constraints.default_factory = PydanticUndefined, None
    default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
    annotation = Annotated[field.annotation, constraints]
    blocks = BLOCK_PARAMETERS.get(name) or PROMOTION_BLOCK_PARAMETERS.get(name)
    if blocks:
        annotation = _block_annotation(field, constraints, blocks)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def flat_parameters(model: type[BaseModel]) -> Callable[[Callable], Callable]:
    """Decorate a function of one ``settings: model`` so that it takes ``model``'s flat parameters.

    Prefect reads the signature (for the deployment's schema and the UI form) and the docstring's
    ``Args:`` section (for the descriptions), both generated here from the model."""
    fields = parameter_fields(model)

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn, updated=())
        def with_parameters(**params):
            return fn(from_parameters(model, params))

        del with_parameters.__wrapped__  # Prefect must see the flat signature, not fn's
        with_parameters.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [_parameter(name, field) for name, field in fields.items()],
            return_annotation=inspect.signature(fn).return_annotation)
        args = "\n".join(f"    {name}: {' '.join((field.description or '').split())}" for name, field in fields.items())
        with_parameters.__doc__ = f"{inspect.getdoc(fn) or ''}\n\nArgs:\n{args}\n"
        return with_parameters

    return decorate
