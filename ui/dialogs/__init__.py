"""The File menu's dialogs: Load model (`load_model`: the embedded default, a GGUF file, a
synthetic model, the models found on this machine) and Get model (`get_model`: the Hugging Face
Hub). Slow work runs on `ui.worker.Worker` threads; main thread only."""
