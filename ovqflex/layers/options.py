"""Layers whose method options are one frozen, validated dataclass (``OVQOptions``, ``KVMOptions``,
``VQOptions``): the layer, its op and its decode path read the same object."""
from __future__ import annotations

import dataclasses
from typing import ClassVar


class OptionAttributes:
    """Mixin of a layer whose options are ``self.options``, an instance of the frozen dataclass
    ``options_type``. Each field reads as an attribute (``layer.max_centroids``); setting one
    replaces ``self.options`` with a copy validated like a constructor argument, so test-time
    overrides (:meth:`ovqflex.models.HybridLM.set_overrides`) are checked by name: they join the
    layer's ``overrides``. The fields in ``fixed_options`` cannot change once the layer is built (its
    parameters depend on them)."""

    options_type: ClassVar[type]
    fixed_options: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "options_type" in cls.__dict__:
            names = [f.name for f in dataclasses.fields(cls.options_type)]
            for name in names:
                setattr(cls, name, _option_attribute(name, name in cls.fixed_options))
            cls.overrides = (*cls.overrides, *(n for n in names if n not in cls.fixed_options))


def _option_attribute(name: str, fixed: bool) -> property:
    def get(self):
        return getattr(self.options, name)

    def set_(self, value):
        if fixed:
            raise AttributeError(f"{name} of a {type(self).__name__} is fixed when it is built")
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(get, set_, doc=f"``self.options.{name}``")
