"""Who may call and how much: API keys, per-key limits, body size (the gate); never imports api/."""
