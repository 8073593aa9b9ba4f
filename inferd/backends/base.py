"""The interface every backend implements: one loaded instance of one model version, running batches.

A backend is built from a version folder (``<repository>/<model>/<version>/``) and its parsed
``config.pbtxt`` (a ``tritonclient.grpc.model_config_pb2.ModelConfig``). The dynamic batcher
(:mod:`inferd.batching`) calls :meth:`Backend.execute` from one thread per instance, never concurrently
on the same instance, so a backend needs no locking of its own.

Tensors are numpy arrays. With ``max_batch_size > 0`` every input and output carries the batch as its
first dimension (the config's ``dims`` exclude it, as in Triton). BYTES tensors are numpy ``object``
arrays whose elements are ``bytes``, as ``tritonclient`` builds them.
"""

from __future__ import annotations

import abc

import numpy as np


class BackendError(Exception):
    """A model could not be loaded or run; the message is shown to the client or in the repository index."""


class InvalidInputError(BackendError):
    """The request's tensors are valid KServe tensors but this model cannot take them (for example a text
    longer than the model's context); the client gets a 400 naming ``input_name``."""

    def __init__(self, message: str, input_name: str | None = None) -> None:
        super().__init__(message)
        self.input_name = input_name


class Backend(abc.ABC):
    """One instance of one model version.

    Args:
        version_dir: the version folder holding the weights (already checked against SHA256SUMS).
        config: the validated model configuration (``ModelConfig`` protobuf message).
        device: ``"cpu"`` or ``"cuda:N"``, from the instance group's kind and gpus.

    Raises:
        BackendError: the weights are missing, unreadable, unsafe (pickled), or do not match the
            config's inputs and outputs.
    """

    def __init__(self, version_dir: str, config, device: str) -> None:
        self.version_dir = version_dir
        self.config = config
        self.device = device

    @abc.abstractmethod
    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            inputs: input name -> array; batch-first (shape ``[B, *dims]``) when the model batches.
                Every required input of the config is present, with its dtype and a shape the config allows.

        Returns:
            output name -> array, batch-first with the same ``B`` when the model batches; every output
            of the config.

        Raises:
            BackendError: the run failed (the batch's requests fail; the instance stays usable).
        """

    def close(self) -> None:
        """Release the instance's memory (sessions, modules). Called once, after its last batch."""
