"""The OpenAI-compatible gateway: tokenize, key, look up, choose, dispatch, stream back."""
