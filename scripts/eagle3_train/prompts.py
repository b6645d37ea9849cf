"""Varied chat prompts written here (code, explanation, lists, Q&A, rewriting, advice), made by
crossing templates with subjects; none is a benchmark workload's prompt."""

from __future__ import annotations

import random

CODE = ["reverses a string", "checks whether a number is prime", "merges two sorted lists",
        "counts the words in a text", "finds the largest element of a list",
        "removes duplicates from a list", "computes the factorial of n",
        "converts Celsius to Fahrenheit", "reads a CSV file and prints each row",
        "returns the n-th Fibonacci number", "checks if a string is a palindrome",
        "sorts a list of dictionaries by a key", "flattens a nested list",
        "computes the average of a list of numbers", "finds the common elements of two lists",
        "validates an email address", "counts vowels in a string",
        "generates a random password", "computes the greatest common divisor",
        "transposes a matrix"]
LANGS = ["Python", "JavaScript", "C", "Go"]
CONCEPTS = ["photosynthesis", "gravity", "inflation", "machine learning", "the water cycle",
            "how vaccines work", "black holes", "the stock market", "climate change",
            "recursion", "DNA", "electricity", "the internet", "compound interest", "evolution",
            "the immune system", "volcanoes", "supply and demand", "encryption", "tides",
            "the seasons", "rainbows", "earthquakes", "democracy", "a database index",
            "the greenhouse effect", "memory in a computer", "sound waves", "magnets",
            "the French Revolution"]
AUDIENCES = ["in simple terms", "to a child", "in one paragraph", "step by step",
             "to a high school student"]
LISTS = ["healthy breakfast ideas", "ways to save money", "tips for learning a language",
         "books everyone should read", "indoor hobbies", "ways to reduce stress",
         "benefits of exercise", "programming languages for beginners", "things to do in Paris",
         "tips for a job interview", "ways to be more productive", "fruits high in vitamin C",
         "common mistakes new programmers make", "uses of baking soda",
         "ways to make a small room look bigger", "good habits for students",
         "ideas for a rainy weekend", "safety tips for cycling", "easy vegetables to grow",
         "questions to ask a doctor"]
NUMBERS = ["three", "five", "seven", "ten"]
QUESTIONS = [
    'What is the capital of Australia?',
    'How many planets are in the solar system?',
    'What causes thunder?',
    'Why do leaves change color in autumn?',
    'How do airplanes stay in the air?',
    'What is the difference between a virus and a bacterium?',
    'Who wrote Romeo and Juliet?',
    'How does a computer store numbers?',
    'What is a healthy amount of sleep for adults?',
    'Why is the ocean salty?',
    'How do bees make honey?',
    'What is the speed of light?',
    'How do I boil an egg?',
    'What is the difference between weather and climate?',
    'Why do cats purr?',
    'How does a battery work?',
    'What is an API?',
    'How do plants know which way is up?',
    'What is a prime number?',
    'How do noise-cancelling headphones work?',
    'Why do we have time zones?',
    'What does a CPU do?',
    'How are mountains formed?',
    'What is a calorie?',
    'Why is exercise good for the brain?',
]
SENTENCES = [
    'hey, can u send me the report by tmrw?',
    'The meeting was moved because nobody could come.',
    'I think that maybe we should probably try a different approach.',
    'Our product is good and people like it a lot.',
    'The cat sat on the mat all day and did nothing.',
    'We regret to inform you that your order is delayed.',
    'Thanks a lot for helping me out yesterday!',
    'The results of the experiment were not what we expected.',
    'Please remember to turn off the lights when you leave.',
    'This restaurant has the best pizza in town.',
]
REWRITES = ["Rewrite this sentence to be more formal: ", "Make this sentence more concise: ",
            "Rewrite this in a friendly tone: ", "Fix the grammar and style: ",
            "Translate this into simple English: "]
ADVICE = ["How can I improve my sleep?", "How do I start running as a beginner?",
          "How can I get better at public speaking?", "How should I prepare for an exam?",
          "How do I write a good cover letter?", "How can I keep my plants alive?",
          "How do I make a budget?", "How can I learn to cook?",
          "How do I organize my desk?", "How can I make new friends in a new city?"]


def all_prompts() -> list[str]:
    out = [f"Write a {lang} function that {task}." for task in CODE for lang in LANGS]
    out += [f"Explain {c} {a}." for c in CONCEPTS for a in AUDIENCES]
    out += [f"List {n} {what}." for what in LISTS for n in NUMBERS]
    out += QUESTIONS + ADVICE
    out += [r + f'"{s}"' for s in SENTENCES for r in REWRITES]
    return out


def split_prompts(n: int, heldout: float = 0.15, seed: int = 0) -> tuple[list[str], list[str]]:
    """`n` prompts drawn from `all_prompts` (seeded), the last `heldout` share kept for eval."""
    prompts = all_prompts()
    random.Random(seed).shuffle(prompts)
    prompts = prompts[:n]
    cut = len(prompts) - round(heldout * len(prompts))
    return prompts[:cut], prompts[cut:]
