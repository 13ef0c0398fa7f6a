"""Narrative prose for `bench accuracy --haystack prose`: a story told by a small grammar.

A haystack of random words is easy to tell apart from a fact; a story is not. `Story(rng)` draws
a cast (names, pronouns, trades), a town with its places and neighbouring towns, then tells scenes
without end: walks, work, weather, memories, news and conversations, while the hours pass, days go
by and the seasons turn. Sentences come from templates whose slots expand recursively (`{slot}`
becomes a random entry of GRAMMAR[slot], itself expanded; the scene's cast and places fill the
rest), so the text rarely repeats itself over a million tokens.

The prose holds no digits, no city of `tasks.CITIES`, none of the needles' activities and not the
words "key" or "value", so a fact inserted in it is the only place its answer is written.
Deterministic from the `random.Random` it is given.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterator

WORDS_PER_TOKEN = 0.44  # prose words per token with the demo tokenizer (measured in tests)

NAMES = tuple(tuple(x.split(":")) for x in (
    "Mara:she Tobias:he Elin:she Ansel:he Bettany:she Corwin:he Dora:she Edmund:he Fenna:she "
    "Gideon:he Hilde:she Isak:he Jonah:he Kerra:she Lenna:she Matthias:he Nell:she Osric:he "
    "Perrin:he Rosalind:she Silas:he Tamsin:she Ulric:he Vera:she Wendel:he Yara:she Agnes:she "
    "Bram:he Cecily:she Dorian:he Effie:she Florian:he Greta:she Hugo:he Ines:she Konrad:he "
    "Lotte:she Magnus:he Nora:she Oswin:he Pia:she Quentin:he Ruth:she Stellan:he Thea:she "
    "Viggo:he Winifred:she Aldous:he Brigid:she Casimir:he").split())
ROLES = ("the miller", "the ferryman", "the baker", "the schoolteacher", "the blacksmith",
         "the innkeeper", "the carter", "the weaver", "the shepherd", "the net mender",
         "the potter", "the herbalist", "the postmistress", "the cooper", "the beekeeper",
         "the lamplighter", "the chandler", "the rope maker", "the midwife", "the tanner")
TOWN_HEADS = ("Ash", "Bram", "Cald", "Dun", "Elder", "Fern", "Gorse", "Hollow", "Kings", "Lark",
              "Marrow", "Nether", "Oak", "Pen", "Rook", "Salt", "Thorn", "Wick", "Whit", "Mill",
              "Stony", "Brack", "Heather", "Cran", "Wold")
TOWN_TAILS = ("ford", "by", "wick", "mere", "stead", "ham", "ton", "field", "bridge", "moor",
              "haven", "combe", "dale", "holt", "well")
PLACES = ("the mill", "the bakery", "the inn", "the square", "the harbour wall", "the chapel",
          "the orchard", "the school house", "the smithy", "the ferry landing", "the weaving shed",
          "the upper pasture", "the post office", "the old quarry", "the boat shed",
          "the churchyard", "the long meadow", "the fish quay", "the tannery", "the ropewalk",
          "the kiln yard", "the ford", "the sheep fold", "the bee garden", "the chandlery")
TIMES = ("at first light", "early in the morning", "in the middle of the morning", "at noon",
         "in the afternoon", "late in the afternoon", "at dusk", "in the evening",
         "late at night")
SEASONS = ("spring", "summer", "autumn", "winter")

# slot -> alternatives; "{x}" in an alternative expands slot x. A, B, C are the scene's people
# (A_he, A_his, A_him their pronouns, A_role their trade), place / place2 its places, town and
# other its towns, time its hour, season the season; "weather" reads the season's own list.
GRAMMAR: dict[str, tuple[str, ...]] = {k: tuple(v.split("|")) for k, v in {
    "went": "walked down to|went over to|made {A_his} way to|hurried to|wandered out to|"
            "climbed the lane to|took the long way round to|set off for",
    "manner": "without much hurry|with {A_his} collar turned up|humming under {A_his} breath|"
              "with a basket on {A_his} arm|as if nothing had happened|deep in thought|"
              "in {A_his} old grey coat|stopping now and then to listen",
    "weather_spring": "a light rain fell and stopped again|the wind came soft from the south|"
                      "the first swallows were back under the eaves|the mud in the lanes had "
                      "begun to dry|the blackthorn was in flower along the hedges|a pale sun "
                      "came and went behind quick clouds",
    "weather_summer": "the heat lay heavy over the rooftops|the air smelled of cut hay|dust rose "
                      "from the road at every step|the swifts screamed high above the chimneys|"
                      "a warm wind stirred the barley|the evenings stayed light for hours",
    "weather_autumn": "a cold mist hung over the water|the leaves were turning along the river|"
                      "the wind tore at the last apples|rain drummed on the slates all day|"
                      "geese went over calling in long lines|the smoke of bonfires drifted "
                      "between the houses",
    "weather_winter": "frost had whitened every roof|the snow lay deep in the ditches|the wind "
                      "off the hills cut through every coat|ice had formed at the edges of the "
                      "pond|the sky was low and the colour of slate|the days were short and the "
                      "lamps were lit early",
    "adj_place": "quiet|crowded|half empty|cold|warm and close|noisy|dim|bright|strangely still",
    "detail": "and smelled of {smell}|with {light}|and nobody seemed to be about|and somebody "
              "had left the door open|the way {A} remembered it from childhood|and {sound}",
    "smell": "wet wool|woodsmoke|fresh bread|tar and salt|crushed mint|old hay|candle wax|"
             "apples going soft|rain on warm stone|lamp oil",
    "light": "long shadows across the floor|a thin light through the shutters|the lamps already "
             "lit|dust turning slowly in the sun|the glow of a dying fire",
    "sound": "a kettle was singing somewhere|the gulls were quarrelling on the roof|a cart "
             "rattled past outside|the water slapped against the stones|a dog barked in the "
             "distance|someone was whistling an old tune",
    "chore": "mending nets|sorting apples|sweeping the floor|stacking firewood|carrying water|"
             "patching the roof|counting sacks of flour|oiling the hinges of the gate|scrubbing "
             "the long table|splitting kindling|hanging washing on the line|salting fish|"
             "grinding oats|writing letters for those who could not|tending the goats|clearing "
             "the gutters|shelling peas|weeding the beds|fixing a broken cart wheel|winding wool",
    "until": "the light began to fail|the bell rang for supper|{B} came looking for {A_him}|"
             "{A_his} hands were sore|the rain drove {A_him} indoors|there was nothing left to "
             "do|{A_his} back would not bend any further|the fire went out",
    "item": "lantern|basket of eggs|coil of rope|bundle of letters|loaf|jug of cider|wooden box|"
            "pair of boots|bolt of cloth|sack of flour|tin cup|blanket|hammer|pipe|shawl|"
            "fishing line|sewing basket|jar of honey|pot of glue|ledger",
    "surface": "table|windowsill|bench|shelf by the door|cart|hearthstone|stool|counter",
    "did_with": "turned it over in {A_his} hands|set it down again|put it under {A_his} arm|"
                "wrapped it in a cloth|carried it out into the yard|gave it to {B}|hid it behind "
                "the flour bins|looked at it for a long time",
    "memory": "the winter {A_he} had spent in {other}|{A_his} {relative}'s kitchen in {other}|"
              "the {season} the river flooded|a song {A_his} {relative} used to whistle at "
              "{fixture_place}|the day {C} left for {other}|the old ferry that sank below the "
              "weir one {season}|the fair at {other} and its painted wagons|the first time "
              "{A_he} had seen the sea|a quarrel with {C} about {quarrel}|the smell of the "
              "schoolroom on wet mornings|walking to {other} with {C} one {season}|the {item} "
              "{A_his} {relative} had left {A_him}|a night at {place2} when {C} told stories "
              "until dawn|the {season} {A_he} first came to {town}",
    "fixture_place": "the {fixture}|{place2}|the kitchen table|the edge of the harbour",
    "quarrel": "money|a borrowed {item}|the {relative} they both loved|nothing at all|"
               "who should mend the fence at {place2}|a promise made at {place2}",
    "feel": "restless|homesick|oddly cheerful|tired to the bone|older than {A_he} was|"
            "glad to be alive|uneasy|light and foolish|a little afraid|at peace with the world",
    "look": "a {build} {A_person} with {feature}|{build} and {feature2}, with a way of "
            "{habit}|a {build} {A_person} who was known in {town} for {habit}",
    "cross": "hurry across|wander towards|stop and talk outside|carry {item_a} into|come back "
             "from|trudge along the wall of|look for someone at",
    "item_a": "a lantern|a basket of eggs|a coil of rope|a bundle of letters|a ladder|an "
              "armful of kindling|two buckets of water",
    "everyone": "everyone in {town}|half of {town}|everyone between {town} and {other}|the "
                "whole street|every family along {place2}",
    "debt": "a favour|a kindness from some hard {season}|money from {time_ref}|an apology for "
            "{quarrel}|a meal or two|a day's work at {place2}",
    "deadline": "dusk|supper|dark|the evening bell|nightfall|the others came back|{C} arrived",
    "build": "tall|small|stooped|broad|thin|sturdy|restless|quiet",
    "feature": "grey eyes and a quick laugh|big careful hands|a scar across one eyebrow|a "
               "voice that carried across the water|hair the colour of straw|a limp from an "
               "old fall|ink stains on every finger",
    "feature2": "weathered|freckled|pale|sunburnt|red cheeked|soft spoken",
    "habit": "answering a question with another question|humming hymns while working|never "
             "finishing a story|remembering every birthday in {town}|walking everywhere at "
             "a run|arguing with the weather",
    "future_act": "come back before the frost|forgive {A_him}|sell the house|write at last|"
                  "marry after all|stay the winter|find what {C_he} was looking for",
    "cargo": "barrels of salt herring|slate for the chapel roof|sacks of seed corn|crates of "
             "crockery|timber from the hill woods|a new millstone|bales of wool",
    "rumour": "selling the mill|building a new bridge at {other}|closing the ferry for the "
              "winter|sending the schoolteacher away|digging a new well behind {place2}|"
              "moving the market to {other}",
    "time_ref": "the spring fair|last {season}|the night of the storm|the wedding|yesterday "
                "morning|the day the ice broke|harvest",
    "saying": "a slow river still reaches the sea|a cold hearth makes for short stories|you "
              "cannot hurry an apple|the hill is steeper for the one who carries the bread|"
              "a borrowed coat never fits|old rope holds best in calm water|every roof leaks "
              "for somebody",
    "direction": "north|south|east|west|north east|south west",
    "relative": "grandmother|father|aunt|uncle|mother|elder brother|godmother",
    "fixture": "pump|back door|woodpile|gate|cellar steps|chimney corner",
    "ask_how": "without looking up|half to {A_him}self|pulling {A_his} shawl tighter|as they "
               "reached {place2}|in a low voice|after a while|with a glance at the {item}|"
               "trying to sound as if it did not matter",
    "turned": "leaned closer|put down the {item}|glanced towards {place2}|lowered {A_his} voice|"
              "stopped {chore}|turned from the window|took a breath",
    "answered": "shook {B_his} head|looked up from the {item}|laughed|thought about it for a "
                "while|shrugged|set down the {item}|frowned at the {surface}|smiled at {A}",
    "gesture": "not looking up|wiping {B_his} hands on {B_his} apron|with a shrug|smiling a "
               "little|after a long pause|lowering {B_his} voice|as if it did not matter",
    "ask": "Have you seen {C} since {time_ref}|Is it true they are {rumour}|Will the road to "
           "{other} be open before {season} is out|Did you bring the {item} I asked for|What do "
           "you make of all this weather|Where is {C} going to sleep tonight|Do you think {C} "
           "will come back from {other}|Who left the gate at {place2} open again|Did you hear "
           "what happened at {place2}|Would you walk with me as far as {place2}",
    "reply": "Not since {time_ref}, and I have been asking everyone|{C} went to {other} after "
             "{time_ref} and has not written since|I left it by the {fixture} at {place2}|"
             "The road will be mud until the end of {season}|My {relative} always said that "
             "{saying}|They say {C} knows more about it than anyone|I would not trust the sky "
             "this {season}, not for a moment|There is bread at {place2} if you are hungry|"
             "We ought to finish {chore} before the weather turns|Ask {C}, not me, I only "
             "heard it at {place2}|I think we both know the answer to that, {A}|Perhaps, if the "
             "wind stays in the {direction}",
    "event": "A cart came in from {other} loaded with {cargo}, and half the street came out to "
             "watch it unloaded|Somewhere beyond {place2} a dog barked, and another answered it|"
             "The chapel bell rang for a long time {time2}, and the sound carried as far as "
             "{place2}|A letter arrived for {A} from {other}, written in a hand {A_he} did not "
             "know|Smoke rose from the chimneys along {place2} and leaned away with the wind|"
             "Two strangers in travelling cloaks "
             "asked at {place2} for the road to {other}|The river rose in the night and "
             "covered the path by {place2}|A fiddler from {other} played on the steps of "
             "{place2} until the children grew tired of dancing",
}.items()}

OPENERS = (
    "{When}, {A} {went} {place}.",
    "{When}, {A} {went} {place}, {manner}.",
    "It was {time} when {A}, {A_role}, {went} {place}.",
    "{A} {went} {place} {time}, {manner}.",
    "{Weather} when {A} reached {place}.",
)
SETTING = (
    "{Place} was {adj_place} at that hour, {detail}.",
    "{Weather}, and {place} was {adj_place}.",
    "Outside {place2}, {weather}.",
    "All over {town}, {weather}, and {sound}.",
    "{Place} was {adj_place}, {detail}.",
)
ACTION = (
    "{A} spent a long while {chore} there, until {until}.",
    "{A_he} took the {item} from the {surface} and {did_with}.",
    "{A} picked up the {item} from the {surface}, then {did_with}.",
    "For a time {A_he} stood at the window of {place}, watching {B} {cross} {place2}.",
    "{A} went on {chore}, {manner}, until {until}.",
    "{A_he} found the {item} on the {surface}, where {C} must have left it.",
    "{A} had promised {C} to help with {chore} and went straight to work.",
    "Nobody else was about at {place}, so {A_he} sat on the {surface} and listened while "
    "{sound}.",
    "{A} had meant to finish {chore} before {deadline}, but {A_his} mind kept wandering.",
    "{A} put the {item} back on the {surface}, thinking of {C}.",
)
THOUGHT = (
    "{A} thought of {memory}.",
    "It put {A_him} in mind of {memory}, and for a while {A_he} felt {feel}.",
    "{A_he} wondered whether {C} would ever {future_act}.",
    "Without knowing why, {A} felt {feel} that {season}.",
    "The thought of {memory} would not leave {A_him} alone.",
    "{A} was {look}.",
    "{A_he} remembered {memory}, and smiled in spite of {A_him}self.",
    "Perhaps it was the {season}, or perhaps it was {memory}, but {A_he} felt {feel}.",
    "{Everyone} knew {A}, {A_role}, and most of them owed {A_him} {debt}.",
)
MEET = (
    "{B} was already at {place} when {A} arrived.",
    "{A} found {B}, {B_role}, {chore_B} near {place}.",
    "On the way {A} met {B}, who had come from {place2}.",
    "{B} came in, shaking the weather off {B_his} coat, and sat down beside {A}.",
    "{A} had not expected to see {B} at {place} {time}.",
    "{B}, who had been {chore_B} since {time_ref}, stopped when {A} came in.",
)
ASK = ('"{ask}?" {A} asked, {ask_how}.', '"{ask}?" asked {A}, {ask_how}.',
       '{A} {turned}. "{ask}?"', '"Tell me, {B}," {A} said, "{ask_low}?"')
REPLY = ('"{reply}," {B} said, {gesture}.', '"{reply}," said {B}, {gesture}.',
         '{B} {answered}. "{reply}."', '"{reply}." {B} looked out towards {place2}.')
PARTING = (
    "They parted at the corner, and {A} walked home alone {time2}.",
    "After that neither of them spoke of {memory} again, and {B} soon went home.",
    "{B} left soon afterwards, and {A} stayed to finish {chore}.",
    "They walked back together as far as {place2}, talking of {memory}.",
)
EVENTS = ("{Event}.", "That {season}, {event_low}.", "Later, {event_low}.")
SEASON_TURN = ("{Season} came to {town} that year {season_how}.",
               "By then it was {season} in {town}, and {weather}.",
               "The weeks went by, and {season} settled over {town}.")
LEAVING = ("That {season} {gone} left {town} for {other}, and {new} became the new {role}.",
           "{gone} packed {gone_his} things and went to live in {other}; it was {new} who took "
           "over as {role}.",
           "When {gone} moved away to {other}, {new} came back to {town} to work as {role}.",
           "Nobody was surprised when {gone} left for {other}, or when {new} took up the work "
           "of {role}.")
SEASON_HOW = ("early and all at once", "slowly, as it always did", "with a week of storms",
              "almost before anyone noticed", "late, after a long wait")
DAY_TURN = ("The next day", "On the following day", "A day later", "After a quiet night",
            "Some days later", "That same week", "Early the next week")

_SLOT = re.compile(r"\{(\w+)\}")


def town_name(rng: random.Random) -> str:
    return rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)


class Story:
    """An endless story over one town: `sentences()` yields (sentence, ends its paragraph)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.cast = rng.sample(NAMES, 8)
        self.roles = {name: role for (name, _), role in zip(self.cast, rng.sample(ROLES, 8),
                                                            strict=True)}
        towns = list(dict.fromkeys(town_name(rng) for _ in range(12)))
        self.town, *self.others = towns
        self.hour, self.day, self.season = rng.randrange(len(TIMES)), 0, rng.randrange(4)
        self.ctx: dict[str, str] = {}

    def expand(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            key = m.group(1)
            cap = key[0].isupper() and key not in self.ctx  # {Place}: capitalised
            low = key.endswith("_low")  # {event_low}: first letter lowered
            key = key.removesuffix("_low")
            key = key[0].lower() + key[1:] if cap else key
            if key in self.ctx:
                out = self.ctx[key]
            else:
                name = f"weather_{SEASONS[self.season]}" if key == "weather" else key
                out = self.expand(self.rng.choice(GRAMMAR[name]))
            if low:
                out = out[0].lower() + out[1:]
            return out[0].upper() + out[1:] if cap else out

        return _SLOT.sub(one, text)

    def _say(self, templates: tuple[str, ...]) -> str:
        s = self.expand(self.rng.choice(templates))
        return s[0].upper() + s[1:]

    def _cast_scene(self, new_day: bool) -> None:
        rng = self.rng
        people = rng.sample(self.cast, 3)
        ctx = {"season": SEASONS[self.season], "town": self.town, "other": rng.choice(self.others),
               "time": TIMES[self.hour], "time2": rng.choice(TIMES[5:])}
        for slot, (name, he) in zip("ABC", people, strict=True):
            ctx[slot] = name
            ctx[f"{slot}_he"] = he
            ctx[f"{slot}_his"] = "her" if he == "she" else "his"
            ctx[f"{slot}_him"] = "her" if he == "she" else "him"
            ctx[f"{slot}_role"] = self.roles[name]
            ctx[f"{slot}_person"] = "woman" if he == "she" else "man"
        ctx["place"], ctx["place2"] = rng.sample(PLACES, 2)
        self.ctx = ctx
        self.ctx["chore_B"] = self.expand("{chore}")
        self.ctx["when"] = rng.choice(DAY_TURN) if new_day else self.expand(
            rng.choice(("{time}", "Later, {time}", "That day, {time}", "{time}")))
        self.ctx["season_how"] = rng.choice(SEASON_HOW)

    def _season_turn(self) -> list[str]:
        """A new season: one of the cast leaves and someone else takes up the trade."""
        rng = self.rng
        self._cast_scene(False)
        i = rng.randrange(len(self.cast))
        (gone, he), new = self.cast[i], rng.choice([n for n in NAMES if n not in self.cast])
        self.cast[i] = new
        self.roles[new[0]] = role = self.roles.pop(gone)
        self.ctx.update(gone=gone, gone_his="her" if he == "she" else "his", new=new[0],
                        role=role.removeprefix("the "))
        return [self._say(SEASON_TURN), self._say(LEAVING)]

    def _scene(self) -> list[list[str]]:
        """One scene: paragraphs of sentences."""
        rng = self.rng
        self.hour += rng.randint(1, 3)
        new_day = self.hour >= len(TIMES)
        if new_day:
            self.hour %= len(TIMES)
            self.day += 1
        paras = []
        if self.day >= 14:  # a season lasts two weeks of story or so; someone leaves town
            self.day = 0
            self.season = (self.season + 1) % 4
            paras.append(self._season_turn())
        self._cast_scene(new_day)
        first = [self._say(OPENERS), self._say(SETTING)]
        first += [self._say(ACTION) for _ in range(rng.randint(1, 3))]
        paras.append(first)
        kind = rng.random()
        if kind < 0.45:  # a conversation: one paragraph per line, as in a novel
            paras.append([self._say(MEET)] + ([self._say(SETTING)] if rng.random() < 0.4 else []))
            for _ in range(rng.randint(1, 3)):
                paras.append([self._say(ASK)])
                paras.append([self._say(REPLY)])
            paras.append([self._say(PARTING)])
        elif kind < 0.75:
            paras.append([self._say(THOUGHT) for _ in range(rng.randint(2, 3))]
                         + [self._say(ACTION)])
        else:
            paras.append([self._say(EVENTS), self._say(THOUGHT), self._say(ACTION)])
        return paras

    def sentences(self) -> Iterator[tuple[str, bool]]:
        while True:
            for para in self._scene():
                for i, s in enumerate(para):
                    yield s, i == len(para) - 1


def paragraphs(rng: random.Random, n: int) -> list[str]:
    """The first `n` paragraphs of a story (for a look at the prose)."""
    out, cur = [], []
    for s, end in Story(rng).sentences():
        cur.append(s)
        if end:
            out.append(" ".join(cur))
            cur = []
            if len(out) == n:
                return out
    return out
