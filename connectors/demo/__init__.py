"""``kvpool demo``: the real small model (SmolLM2-135M-Instruct) serving three tenants' chats through the
transformers connector, with and without the pool. Apart from the connectors, which never import it."""
