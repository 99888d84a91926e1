"""Built-in prompt corpus: a few KB of public-domain English prose (19th-century novels).

Prompts are cut from its token ids (wrapping around), so any requested length is exact.
"""

CORPUS = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be \
in want of a wife. However little known the feelings or views of such a man may be on his first \
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that \
he is considered the rightful property of some one or other of their daughters. "My dear Mr. Bennet," \
said his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet \
replied that he had not. "But it is," returned she; "for Mrs. Long has just been here, and she told \
me all about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" cried his \
wife impatiently. "You want to tell me, and I have no objection to hearing it." This was invitation \
enough.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and see \
the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand \
of me, that it requires a strong moral principle to prevent me from deliberately stepping into the \
street, and methodically knocking people's hats off, then, I account it high time to get to sea as \
soon as I can. This is my substitute for pistol and ball. There is nothing surprising in this. If \
they but knew it, almost all men in their degree, some time or other, cherish very nearly the same \
feelings towards the ocean with me.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, \
it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had \
everything before us, we had nothing before us, we were all going direct to Heaven, we were all going \
direct the other way. In short, the period was so far like the present period, that some of its \
noisiest authorities insisted on its being received, for good or for evil, in the superlative degree \
of comparison only.

Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to \
do: once or twice she had peeped into the book her sister was reading, but it had no pictures or \
conversations in it, "and what is the use of a book," thought Alice, "without pictures or \
conversations?" So she was considering in her own mind (as well as she could, for the hot day made \
her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the \
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close \
by her. There was nothing so very remarkable in that; nor did Alice think it so very much out of the \
way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!"

You will rejoice to hear that no disaster has accompanied the commencement of an enterprise which you \
have regarded with such evil forebodings. I arrived here yesterday, and my first task is to assure my \
dear sister of my welfare and increasing confidence in the success of my undertaking. I am already \
far north of London, and as I walk in the streets of Petersburgh, I feel a cold northern breeze play \
upon my cheeks, which braces my nerves and fills me with delight. Do you understand this feeling? \
This breeze, which has travelled from the regions towards which I am advancing, gives me a foretaste \
of those icy climes.

In my younger and more vulnerable years the world seemed a wide and open field. Marley was dead: to \
begin with. There is no doubt whatever about that. The register of his burial was signed by the \
clergyman, the clerk, the undertaker, and the chief mourner. Scrooge signed it: and Scrooge's name \
was good upon 'Change, for anything he chose to put his hand to. Old Marley was as dead as a \
door-nail. Mind! I don't mean to say that I know, of my own knowledge, what there is particularly \
dead about a door-nail. I might have been inclined, myself, to regard a coffin-nail as the deadest \
piece of ironmongery in the trade. But the wisdom of our ancestors is in the simile; and my \
unhallowed hands shall not disturb it, or the Country's done for.

Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in \
confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an \
intrigue with a French girl, who had been a governess in their family, and she had announced to her \
husband that she could not go on living in the same house with him. This position of affairs had now \
lasted three days, and not only the husband and wife themselves, but all the members of their \
family and household, were painfully conscious of it.
"""
