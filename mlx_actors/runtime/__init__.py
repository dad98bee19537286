"""The runtime layer: finding and loading models (the embedded default, a local directory,
a GGUF file or a Hugging Face id) and the ``Runtime`` that runs agents on one of them."""

from ..scheduler import Expected as Expected
from ._default import default_model_dir as default_model_dir
from ._main import run as run
from ._models import LoadedModel as LoadedModel
from ._models import load_model as load_model
from ._models import resolve_model as resolve_model
from ._runtime import Runtime as Runtime
from ._statistics import RuntimeStatistics as RuntimeStatistics
