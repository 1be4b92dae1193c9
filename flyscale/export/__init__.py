"""Models as files anyone can serve without flyscale (ONNX)."""
