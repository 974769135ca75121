"""Cloud server: finishes the model, with early exits and feature caches."""
