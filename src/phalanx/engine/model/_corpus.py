"""The fixed text the embedded default model's tokenizer is trained on (never change
it: the default model's digest, pinned by a test, depends on every byte)."""

CORPUS = """\
phalanx runs jobs with one process per rank, the shape of tensor-parallel inference.
A worker starts and supervises the rank processes and runs orchestration functions whose
tasks run in the ranks. Every run ends at a fence, after which everything it acquired is
released. Communication domains are subsets of ranks with symmetric shared-memory
windows, a barrier and collectives; they are allocated and released thousands of times
without leaking a file, a shared-memory name, a socket or a thread.

Every resource has an owner from the moment it exists. It is released exactly once, in
reverse dependency order, after its users have stopped. When a release fails, the
failure is visible and the resource stays owned: never forgotten, never freed twice.

The prefix cache keeps the keys and values of token prefixes on every rank's local disk.
It is recovered after a restart, held under a size cap, aged out, compacted, and kept
identical across ranks by rank zero, which decides every record operation and replicates
it to its peers over links with flow control, so that no burst of work can break the job.

The engine loads a model from a directory: its configuration, its weights, its tokenizer
and its chat template. Attention heads and the columns of the feed-forward layers are
split across the ranks; each rank reads only its own slices of the weights. The scheduler
admits requests, plans each step, and sends the same plan to every rank. Rank zero samples
the next token of every running sequence and the server streams it back to the client.

Hello! How are you today? I am fine, thank you. What would you like to talk about?
Tell me a story about a small robot who learns to paint. Once upon a time, in a quiet
town by the sea, there lived a little robot named Pip. Every morning Pip watched the sun
rise over the water and wished it could keep the colours forever. One day an old painter
gave Pip a brush, a box of paints and a simple piece of advice: look closely, and be
patient. Pip painted the harbour, the boats, the gulls and the clouds. The first pictures
were strange and crooked, but the robot kept trying, and by the end of the summer the
whole town came to see its work.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 65536.
Dates and times: 2024-05-17 09:30, 1999-12-31 23:59, 12:00 noon, 7 p.m., 45 minutes.
Code: def add(a, b): return a + b. for i in range(10): print(i * i). x = [1, 2, 3].
if (n > 0) { return n - 1; } else { return 0; } // a comment /* another comment */
Paths and names: /var/cache/phalanx, rank-0, model.safetensors, config.json, README.md.

Questions and answers. What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. Why is the sky blue? Sunlight is scattered
by the air, and blue light is scattered more than red light. Which planet is the largest?
Jupiter is the largest planet in the solar system. Who wrote the plays Hamlet and Macbeth?
William Shakespeare wrote them. How many days are in a week? There are seven days.
Spring, summer, autumn and winter are the four seasons of the year. Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week. January,
February, March, April, May, June, July, August, September, October, November, December.

Colours: red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown.
Animals: cat, dog, horse, cow, sheep, goat, pig, chicken, duck, rabbit, mouse, lion,
tiger, bear, wolf, fox, deer, eagle, owl, whale, dolphin, shark, salmon, butterfly, bee.
Food: bread, butter, cheese, milk, eggs, rice, pasta, soup, salad, apple, banana, orange,
grape, lemon, strawberry, tomato, potato, carrot, onion, garlic, pepper, salt, sugar, tea.
Verbs: be, have, do, say, go, get, make, know, think, take, see, come, want, look, use,
find, give, tell, work, call, try, ask, need, feel, become, leave, put, mean, keep, let,
begin, seem, help, talk, turn, start, show, hear, play, run, move, like, live, believe,
hold, bring, happen, write, provide, sit, stand, lose, pay, meet, include, continue, set,
learn, change, lead, understand, watch, follow, stop, create, speak, read, allow, add,
spend, grow, open, walk, win, offer, remember, love, consider, appear, buy, wait, serve,
die, send, expect, build, stay, fall, cut, reach, kill, remain, suggest, raise, pass.

A good answer is short, correct and kind. When you do not know something, say so, and
explain how you would find out. Measure before you optimise; write the test that can
fail; name who, what and why in every error message; and leave nothing behind.
"""
