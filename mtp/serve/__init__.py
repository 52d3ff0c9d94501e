"""`mtp-serve`: the OpenAI-compatible server (`app.py`), its request validation (`protocol.py`), the reply text
(`stream.py`), where generation runs (`backend.py`) and its metrics (`metrics.py`). Needs the `serve` extra
(`pip install -e ".[serve]"`: FastAPI, uvicorn, prometheus-client); the Hydra entry is `eval/serve.py`."""
