"""Weight offloading and fused weight-gradient accumulation."""
