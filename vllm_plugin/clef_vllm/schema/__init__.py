"""The SystemOne wire contract: request models and dialects, encoding to prompts, answers, errors, records."""
