"""Images in chat: pixels -> patches (processor.py); the vision tower itself is replicas/models/qwen3_5_vision.py."""
