"""How octfw checks a component against a protocol: the metaclass of every stage protocol
(:class:`_CapabilityMeta`: ``isinstance`` looks members up with ``getattr`` on every Python),
the members a protocol declares and those a component lacks."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

__all__ = ["protocol_members", "provides", "missing_members"]


if TYPE_CHECKING:  # pragma: no cover - a checker sees a plain metaclass
    _TypingProtocolMeta = type
else:
    _TypingProtocolMeta = type(Protocol)  # typing's metaclass of every Protocol, on every Python


class _CapabilityMeta(_TypingProtocolMeta):
    """The metaclass of octfw's protocols: ``isinstance(component, Protocol)`` looks each
    member up as the code that then uses it does, with ``getattr``, on every Python.

    Python 3.12 changed how ``isinstance`` checks a ``runtime_checkable`` protocol: it looks
    members up with ``inspect.getattr_static`` (the instance's and the classes' ``__dict__``),
    which never calls ``__getattr__``. A ``torch.nn.Module`` keeps its submodules,
    parameters and buffers in ``_modules``, ``_parameters`` and ``_buffers`` and serves them
    through ``__getattr__``, so on 3.12 and later a model whose ``encoder`` is a submodule
    (``mae3d``) was no :class:`EncoderModel`: its run ended without ``RUN/encoder`` and said
    nothing, and ``octfw export`` and the fine-tune evaluators refused it (``vjepa3d``'s
    ``encoder``, a property, was found).

    This keeps 3.10's and 3.11's rule on every Python: a component has a protocol when
    ``getattr`` finds every member :func:`protocol_members` names, and none of the protocol's
    methods is None there (None blocks a method, as in typing), which is :func:`provides`.
    Where that fails, typing's own check decides: a class that subclasses the protocol
    nominally has it (so does whatever 3.12's lookup finds: a descriptor that raises
    ``AttributeError``). On 3.11 the answer is the one ``isinstance`` always gave.

    One metaclass rather than a helper at each call site, so that every check, octfw's and
    a plugin's, stays ``isinstance(component, Protocol)`` as the plugin guide says; and rather
    than members declared so that ``getattr_static`` finds them (a property per submodule),
    which would leave a third-party model that assigns ``self.encoder = ...`` without its
    capability on 3.12, silently. ``tests/test_protocols.py`` checks every built-in
    component under 3.12's lookup, emulated on 3.11 and for real on 3.12.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        if (getattr(cls, "_is_protocol", False) and getattr(cls, "_is_runtime_protocol", False)
                and provides(instance, cls)):
            return True
        return super().__instancecheck__(instance)


_DUNDERS_DECLARED = ("__call__", "__len__")


def protocol_members(protocol: type, *, inherited: bool = True) -> tuple[str, ...]:
    """The members ``protocol`` declares, methods and attributes, in declaration order.

    ``inherited=False``: only those it adds to the protocols it extends
    (``SourcedDataset`` adds ``source`` and ``label`` to ``Dataset``)."""
    bases = [b for b in reversed(protocol.__mro__) if getattr(b, "_is_protocol", False) and b is not Protocol]
    inherited_names = {n for b in bases if b is not protocol for n in protocol_members(b)} if bases[:-1] else set()
    names: list[str] = []
    for base in bases if inherited else [protocol]:
        for name in [*base.__dict__.get("__annotations__", {}), *base.__dict__]:
            if (name.startswith("_") and name not in _DUNDERS_DECLARED) or name in names:
                continue
            if not inherited and name in inherited_names:
                continue
            names.append(name)
    return tuple(names)


@functools.lru_cache(maxsize=None)
def _declared(protocol: type) -> tuple[str, ...]:
    return protocol_members(protocol)  # once per protocol: isinstance runs on the hot path (EMAModel)


def provides(component: Any, protocol: type) -> bool:
    """Whether ``component`` has ``protocol``: ``getattr`` finds each of its members, and no
    method among them is None. ``isinstance(component, protocol)`` asks this for octfw's
    protocols on every Python (:class:`_CapabilityMeta`), the submodules, parameters and
    buffers of a ``torch.nn.Module`` included, which Python 3.12's own lookup does not see."""
    for name in _declared(protocol):
        try:
            value = getattr(component, name)
        except AttributeError:
            return False
        if value is None and callable(getattr(protocol, name, None)):
            return False
    return True


def missing_members(component: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``component`` lacks (a method that is present but
    not callable counts as missing). ``isinstance(component, protocol)`` only asks whether
    each name exists; this also tells which."""
    missing = []
    for name in protocol_members(protocol):
        # A dunder is looked up on the type, as Python does when it calls it.
        owner = type(component) if name in _DUNDERS_DECLARED else component
        if not hasattr(owner, name):
            missing.append(name)
        elif callable(getattr(protocol, name, None)) and not callable(getattr(owner, name)):
            missing.append(name)
    return missing
