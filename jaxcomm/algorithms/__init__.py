"""Parameter-level algorithms: decentralized D-PSGD and EventGraD (and eager-SGD).

:func:`dpsgd` and :func:`eventgrad` build a :class:`DecentralizedAlgorithm` (EventGraD's is an
:class:`EventGrad`) that :func:`simulate_decentralized` trains on ``P`` simulated workers, with
:func:`replicate` and :func:`per_worker` to stack and lift per-worker trees and
:func:`average_model` for the final model; :class:`OneSidedEventGrad` runs EventGraD over MPI
with one-sided puts. :func:`eager_sgd` is eager-SGD's partial allreduce on a mesh axis as an
optax transformation; :func:`simulate_training` trains with it and :func:`staleness_profile`
measures the staleness an :class:`EagerSGDConfig` produces.
"""

from ._dpsgd import (
    DecentralizedAlgorithm,
    average_model,
    dpsgd,
    per_worker,
    replicate,
    simulate_decentralized,
)
from ._eager_sgd import EagerSGDConfig, eager_sgd, simulate_training, staleness_profile
from ._eventgrad import EventGrad, OneSidedEventGrad, eventgrad

__all__ = [
    "DecentralizedAlgorithm",
    "dpsgd",
    "replicate",
    "per_worker",
    "simulate_decentralized",
    "average_model",
    "EventGrad",
    "eventgrad",
    "OneSidedEventGrad",
    "EagerSGDConfig",
    "eager_sgd",
    "simulate_training",
    "staleness_profile",
]
