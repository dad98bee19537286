"""The layer under the agents: three prompts batched through the block-pool engine,
printed as they finish. No actors, no async: token ids in, tokens and blocks out.

    python examples/batch_engine.py [MODEL]
"""

import sys

from mlx_actors.runtime import load_model
from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec

loaded = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
spec = ModelCacheSpec.from_model(loaded.model)
pool = BlockPool(spec, total_blocks=512)
engine = BlockPoolBatchEngine(loaded.model, loaded.tokenizer, pool)

questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about tea."]
for question in questions:
    messages = [{"role": "user", "content": question}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine.submit(question, prompt, max_tokens=64)

while engine.active:
    for done in engine.step():
        print(f"Q: {done.agent_id}\nA: {done.text}")
        print(f"   ({done.usage.generated_tokens} tokens, {done.blocks.num_blocks} blocks)\n")
        engine.release(done.blocks)
print(f"pool after: {pool.statistics().used_blocks} blocks used")
