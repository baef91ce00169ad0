"""The EP strategy objects live in the spec layer (`planc.spec.ep`): lint and the compiler call the
same pure `resolve_ep`. Re-exported here for the compiler's callers."""

from planc.spec.ep import AllReduceEP, AllToAllEP, AutoEP, EPResolutionError, EPStrategy, MegaMoeEP, resolve_ep

__all__ = ["AllReduceEP", "AllToAllEP", "AutoEP", "EPResolutionError", "EPStrategy", "MegaMoeEP", "resolve_ep"]
