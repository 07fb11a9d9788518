"""What the style corpus talks about: topics, prompt templates, and per-subject advice.

Pure data, shared by every style (see apps/default_model/corpus.py). Tips are imperative
verb phrases that read after "to", "must" or "you"; reasons are clauses that read
after "because" or "for". Prompt templates take the subject as ``{s}``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subject:
    name: str
    tips: tuple[str, str]
    reason: str


@dataclass(frozen=True)
class Topic:
    name: str
    prompt_templates: tuple[str, ...]
    subjects: tuple[Subject, ...]


def _subjects(*rows: tuple[str, str, str, str]) -> tuple[Subject, ...]:
    return tuple(Subject(name, (tip_a, tip_b), reason) for name, tip_a, tip_b, reason in rows)


TOPICS: tuple[Topic, ...] = (
    Topic("cooking", (
        "How do I make {s}?", "Any tips for cooking {s}?", "What is the secret to making {s}?",
        "I want to make {s} tonight. Any advice?", "What should I know before making {s}?",
    ), _subjects(
        ("rice", "rinse the grains until the water runs clear", "let it rest covered for ten minutes",
         "the extra starch washes away"),
        ("pancakes", "leave a few lumps in the batter", "wait for bubbles before flipping",
         "overmixing makes them tough"),
        ("soup", "brown the onions slowly first", "season it again just before serving",
         "the flavours deepen as it simmers"),
        ("pasta", "salt the water generously", "save a cup of the cooking water",
         "the starchy water helps the sauce cling"),
        ("an omelette", "keep the pan on medium heat", "fold it while the top is still soft",
         "eggs turn rubbery when overcooked"),
        ("bread", "knead the dough until it feels springy", "let it rise somewhere warm",
         "the yeast needs warmth to work"),
    )),
    Topic("weather", (
        "How should I prepare for {s}?", "What should I wear for {s}?", "Any advice for {s}?",
        "We are expecting {s} tomorrow. What should I do?", "How do I stay comfortable during {s}?",
    ), _subjects(
        ("a rainy day", "carry a small umbrella", "wear shoes that keep water out",
         "wet socks ruin the whole day"),
        ("a heat wave", "drink water every hour", "keep the curtains closed at midday",
         "the body loses fluid quickly in the heat"),
        ("heavy snow", "clear the path early", "keep a warm blanket in the car",
         "roads can close without warning"),
        ("strong wind", "tie down loose garden furniture", "avoid walking under old trees",
         "gusts can snap weak branches"),
        ("a thunderstorm", "stay indoors until it passes", "unplug sensitive electronics",
         "lightning can strike far from the rain"),
        ("a cold morning", "dress in thin warm layers", "warm up with a hot drink",
         "layers trap heat better than one thick coat"),
    )),
    Topic("travel", (
        "How do I prepare for {s}?", "Any tips for {s}?", "What should I pack for {s}?",
        "I am nervous about {s}. Any advice?", "How can I enjoy {s} more?",
    ), _subjects(
        ("a long flight", "drink plenty of water", "stand up and stretch every hour",
         "cabin air is very dry"),
        ("a road trip", "plan a stop every two hours", "pack snacks within easy reach",
         "tired drivers make mistakes"),
        ("a train journey", "book a window seat early", "bring a good book",
         "the scenery makes the hours pass"),
        ("a trip abroad", "keep copies of your passport", "learn a few local phrases",
         "small efforts earn warm welcomes"),
        ("a weekend in the city", "pick two sights and skip the rest", "walk between places when you can",
         "rushing spoils the fun"),
        ("a camping trip", "test the tent at home first", "pack a warm layer for the night",
         "nights outdoors get colder than expected"),
    )),
    Topic("pets", (
        "How do I care for {s}?", "Any tips for looking after {s}?", "What does {s} need?",
        "I just got {s}. What should I know?", "How do I keep {s} happy?",
    ), _subjects(
        ("a new puppy", "set a simple daily routine", "reward good behaviour right away",
         "puppies learn fast from consistency"),
        ("an old cat", "give it a soft warm bed", "book regular checkups with the vet",
         "older cats hide their aches"),
        ("a goldfish", "change part of the water weekly", "feed it only a small pinch",
         "leftover food fouls the tank"),
        ("a rabbit", "give it plenty of fresh hay", "let it roam safely every day",
         "rabbits need to chew and run"),
        ("a parrot", "talk to it every day", "offer new toys often",
         "parrots get bored very easily"),
        ("a hamster", "provide a deep layer of bedding", "let it sleep during the day",
         "hamsters are busy at night"),
    )),
    Topic("work", (
        "How do I handle {s}?", "Any tips for {s}?", "I am stressed about {s}. Any advice?",
        "What is the best way to approach {s}?", "How can I do well with {s}?",
    ), _subjects(
        ("a job interview", "research the company beforehand", "prepare three short stories about your work",
         "concrete examples are easy to remember"),
        ("a busy week", "list the three most important tasks each morning", "say no to extra meetings",
         "focus beats scattered effort"),
        ("a difficult meeting", "write down your main point first", "listen fully before you reply",
         "calm answers lower the tension"),
        ("a long report", "outline the sections before writing", "write the summary last",
         "structure makes the writing faster"),
        ("a new manager", "ask how they like updates", "share your current priorities early",
         "clear expectations prevent friction"),
        ("a team project", "agree on who owns each task", "check in briefly twice a week",
         "small problems surface early"),
    )),
    Topic("health", (
        "How do I deal with {s}?", "Any tips for {s}?", "What helps with {s}?",
        "I am struggling with {s}. Any advice?", "What is good for {s}?",
    ), _subjects(
        ("a cold", "rest as much as you can", "sip warm fluids through the day",
         "the body heals best while resting"),
        ("poor sleep", "keep the same bedtime every night", "put screens away an hour before bed",
         "bright light delays sleepiness"),
        ("back pain", "take short walks often", "check the height of your chair",
         "gentle movement loosens tight muscles"),
        ("a headache", "drink a large glass of water", "rest in a dim quiet room",
         "dehydration often causes headaches"),
        ("low energy", "eat breakfast with some protein", "get outside in daylight",
         "sunlight sets the body clock"),
        ("stress", "take slow deep breaths", "write your worries on paper",
         "naming a worry makes it smaller"),
    )),
    Topic("music", (
        "How do I learn {s}?", "Any tips for practicing {s}?", "I am a beginner at {s}. Any advice?",
        "How can I improve at {s}?", "What should I focus on with {s}?",
    ), _subjects(
        ("the guitar", "practice chord changes slowly", "keep your nails short",
         "slow practice builds clean habits"),
        ("the piano", "learn each hand separately first", "count the beats out loud",
         "rhythm matters as much as the notes"),
        ("singing", "warm up your voice gently", "breathe from your belly",
         "steady breath supports the tone"),
        ("the drums", "practice with a metronome", "keep your wrists relaxed",
         "tension makes you tire quickly"),
        ("the violin", "tune before every session", "play long slow bows",
         "slow bows train a steady sound"),
        ("songwriting", "start with a simple chorus", "write a little every day",
         "habits matter more than inspiration"),
    )),
    Topic("books", (
        "How do I get into {s}?", "Any tips for reading {s}?", "How do I finish {s}?",
        "What is the best way to enjoy {s}?", "I find {s} hard to follow. Any advice?",
    ), _subjects(
        ("a long novel", "read twenty pages a day", "keep a list of the characters",
         "steady progress adds up quickly"),
        ("poetry", "read each poem aloud", "read it twice before judging",
         "poems reveal more on a second reading"),
        ("a history book", "skim the chapter headings first", "note the key dates as you go",
         "a rough map helps details stick"),
        ("a mystery story", "jot down your suspects", "watch for small odd details",
         "authors hide clues in plain sight"),
        ("a science book", "look up unfamiliar terms", "explain each chapter to a friend",
         "teaching an idea tests your grasp"),
        ("a classic novel", "read a short summary first", "forgive the slow opening chapters",
         "old books take time to warm up"),
    )),
    Topic("sports", (
        "How do I get started with {s}?", "Any tips for {s}?", "How can I improve at {s}?",
        "What should a beginner know about {s}?", "How do I stay motivated with {s}?",
    ), _subjects(
        ("running", "start slower than feels natural", "increase your distance gradually",
         "joints need time to adapt"),
        ("swimming", "focus on breathing out underwater", "practice short lengths often",
         "relaxed breathing saves energy"),
        ("tennis", "watch the ball onto the strings", "move your feet before every shot",
         "good footwork sets up clean strokes"),
        ("cycling", "check your tyre pressure weekly", "keep a steady easy cadence",
         "smooth pedalling spares the knees"),
        ("yoga", "move slowly with your breath", "never force a stretch",
         "flexibility grows with patience"),
        ("football", "practice passing with both feet", "keep your head up when dribbling",
         "seeing the field creates chances"),
    )),
    Topic("tech", (
        "How do I deal with {s}?", "Any tips for {s}?", "What should I do about {s}?",
        "I am annoyed by {s}. Any advice?", "How do I fix {s}?",
    ), _subjects(
        ("a slow laptop", "close programs you are not using", "restart it at least once a week",
         "memory fills up over time"),
        ("a dying phone battery", "lower the screen brightness", "turn off apps that run in the background",
         "the screen drains the most power"),
        ("weak passwords", "use a password manager", "turn on two factor sign in",
         "reused passwords leak easily"),
        ("a full inbox", "unsubscribe from newsletters you skip", "archive anything older than a month",
         "clutter hides the important mail"),
        ("a noisy fan", "clean the dust from the vents", "keep the machine on a hard surface",
         "blocked air makes the fan work harder"),
        ("lost files", "check the recycle bin first", "set up automatic backups",
         "backups turn disasters into small chores"),
    )),
    Topic("gardening", (
        "How do I grow {s}?", "Any tips for growing {s}?", "How often should I water {s}?",
        "My {s} look sad. What can I do?", "What do {s} need to thrive?",
    ), _subjects(
        ("tomatoes", "plant them in full sun", "water the soil rather than the leaves",
         "wet leaves invite disease"),
        ("roses", "prune them in early spring", "feed them after the first flowers",
         "pruning encourages strong new growth"),
        ("herbs", "pick the leaves often", "grow them near the kitchen door",
         "regular picking keeps them bushy"),
        ("houseplants", "water only when the soil feels dry", "turn the pots every week",
         "soggy roots rot quickly"),
        ("strawberries", "mulch around them with straw", "remove runners in the first year",
         "the plant saves energy for fruit"),
        ("peppers", "start the seeds indoors early", "give them a warm sheltered spot",
         "peppers love heat"),
    )),
    Topic("home", (
        "How do I tackle {s}?", "Any tips for {s}?", "What is the fastest way to sort out {s}?",
        "I am overwhelmed by {s}. Any advice?", "How do I keep on top of {s}?",
    ), _subjects(
        ("a messy kitchen", "wash up right after each meal", "clear one counter completely",
         "a clean surface invites more tidying"),
        ("a cluttered closet", "donate clothes you have not worn in a year", "sort items by type",
         "less stuff means easier choices"),
        ("dusty shelves", "wipe them with a damp cloth", "dust from top to bottom",
         "dust falls downward as you clean"),
        ("a dirty oven", "spread baking soda paste inside overnight", "wipe spills while they are fresh",
         "fresh spills lift off easily"),
        ("a crowded desk", "keep only daily tools on top", "give every item a home",
         "a clear desk helps you focus"),
        ("muddy floors", "put a sturdy mat by the door", "sweep before you mop",
         "mud spreads when it gets wet"),
    )),
    Topic("money", (
        "How do I handle {s}?", "Any tips for {s}?", "What is a good approach to {s}?",
        "I am struggling with {s}. Any advice?", "Where do I start with {s}?",
    ), _subjects(
        ("a monthly budget", "track every expense for a month", "set spending limits by category",
         "you cannot fix what you do not measure"),
        ("saving for a trip", "open a separate savings account", "move money on payday automatically",
         "unseen money is not spent"),
        ("paying off debt", "pay the highest interest first", "never miss a minimum payment",
         "interest grows faster than you expect"),
        ("grocery costs", "plan meals before you shop", "buy staples in bulk",
         "lists prevent impulse buys"),
        ("impulse shopping", "wait a full day before buying", "delete saved card details",
         "most urges fade overnight"),
        ("an emergency fund", "aim for three months of expenses", "start with a small fixed amount",
         "a cushion turns crises into inconveniences"),
    )),
    Topic("study", (
        "How do I approach {s}?", "Any tips for {s}?", "What is the best way to tackle {s}?",
        "I am falling behind with {s}. Any advice?", "How do I stay focused on {s}?",
    ), _subjects(
        ("a new language", "practice a little every day", "speak out loud from the start",
         "short daily sessions beat long rare ones"),
        ("an exam", "test yourself instead of rereading", "sleep well the night before",
         "recall strengthens memory"),
        ("math homework", "work through examples by hand", "check each step before moving on",
         "small errors snowball"),
        ("a history test", "build a simple timeline", "connect events to their causes",
         "stories are easier to recall than lists"),
        ("memorizing facts", "use flashcards with spaced repetition", "review just before sleep",
         "sleep locks in new memories"),
        ("an online course", "set fixed study hours", "take notes by hand",
         "writing slows you down enough to think"),
    )),
)
