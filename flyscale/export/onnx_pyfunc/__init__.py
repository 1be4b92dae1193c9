"""A registered flyscale model as MLflow serves it: an ONNX file and ONNX Runtime, nothing of flyscale.

MLflow keeps this folder as the model's code: `python_model.py` is the model (a model from code,
`python_model=`), and the folder travels beside it (`code_paths`), so the served model imports
the copy registered with it. The model's artifacts are `onnx` (the model), `serving` (a small
JSON that says what the model takes and returns) and, for a language model, `tokenizer`. The
PyTorch weights and the spec that rebuilds the architecture travel too (`weights`, `spec`), for
fine-tuning; serving never reads them.

The modules here import only the standard library, numpy, MLflow and (when loading)
onnxruntime, `tokenizers` for a BPE language model and Pillow for an image model that is sent
PNG or JPEG files: those are the model's declared requirements, so it loads where neither
flyscale, nor a plugin package, nor torch is installed. Keep it that way: an import of flyscale
here breaks every registered model served without it. They import each other relatively
(`from .errors import ...`), which holds both inside flyscale and in the copy MLflow carries.
Nothing here unpickles: a version registered with a torch.export program (`program`, .pt2) by an
older flyscale is refused, since torch.export.load may fall back to
`torch.load(weights_only=False)` and runs code the file carries.

- `predictor.py`: the ONNX model and what a request may send it (`Served`);
- `request_inputs.py`: what was sent, read into an array or prompts;
- `generation.py`: a language model's tokenizers and its token-by-token generation;
- `errors.py`: the one-line refusals (HTTP 400) and failures (HTTP 500);
- `python_model.py`: the MLflow model, the file MLflow loads.

Versions registered before this folder existed carry one file of their own, `served.py`, which
still loads as it was registered.
"""

from pathlib import Path

PYTHON_MODEL = str(Path(__file__).with_name("python_model.py"))  # MLflow's python_model=
CODE = str(Path(__file__).parent)  # MLflow's code_paths: the folder the model imports
