"""The conversion's orchestration: options made concrete, the layer-wise driver, reports and verification."""
