"""What torch's ONNX exporters print that says nothing about the model being exported.

:func:`quiet_onnx_export` wraps every ``torch.onnx.export`` call in the zoo (the demo's
model, the test and benchmark models, the VAD). It hides, for the duration of the call
only:

- the dynamo exporter's ``torchvision is not installed. Skipping torchvision::nms`` lines
  (one per torchvision op, logged as warnings by
  ``torch.onnx._internal.exporter._registration`` when it builds its op table on the
  first export of a process): tierflow never installs torchvision and exports no
  torchvision op, so a user reads them as a fault in the install. Only records with that
  message are dropped; any other warning of that logger still shows;
- torch's own DeprecationWarning and FutureWarning raised inside the exporters (about
  torch internals, not the caller's model).

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

#: The logger torch's dynamo exporter reports a missing torchvision through.
REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"
_TORCHVISION_NOTICE = "torchvision is not installed"


class _DropTorchvisionNotice(logging.Filter):
    """Drops the exporter's "torchvision is not installed. Skipping ..." records only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TORCHVISION_NOTICE)


@contextlib.contextmanager
def quiet_onnx_export() -> Iterator[None]:
    """Run a torch.onnx export without the notices that are not about the model."""
    notice = _DropTorchvisionNotice()
    logger = logging.getLogger(REGISTRATION_LOGGER)
    logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            # Several inputs share one batch dimension; the exporter says it keeps one name.
            warnings.filterwarnings(
                "ignore", message=".*axis name.*will not be used", category=UserWarning
            )
            yield
    finally:
        logger.removeFilter(notice)
