"""Ordinary English words that synthetic prompts are built from."""

from __future__ import annotations

WORDS = tuple(
    """
    the of and to in is was for on that with as by at from his her an which or are be this had
    not but have it they one were all their there been has more when will would who so no time
    people year way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book
    eye job word business issue side kind head house service friend father power hour game line
    end member law car city community name president team minute idea kid body information back
    parent face others level office door health person art war history party result change
    morning reason research girl guy moment air teacher force education river bread green small
    large old new good long great little own other right big high different early young
    important few public bad same able open light field table window paper music market road
    garden winter summer spring autumn tree stone horse bird letter voice picture street town
    village island ocean mountain forest bridge train plane ship train glass chair bed wall floor
    kitchen dinner lunch breakfast coffee milk sugar salt apple orange river lake cloud rain
    snow wind fire sun moon star sky color blue red white black yellow brown simple quick slow
    warm cold dark bright quiet loud soft hard clean free full empty heavy easy
    """.split()
)
